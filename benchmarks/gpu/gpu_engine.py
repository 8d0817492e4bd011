"""The GPU check's engine section (check.py): a dummy-weight model per attention backend, with
and without CUDA graphs: the real scheduler at each batch, bare decode steps and a prefill
step, each against its roofline (gpu_roofline.py)."""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
from gpu_roofline import decode_bytes, prefill_flops
from gpu_run import Run, free_memory, section, skip_reason_flashinfer, sync, timed


def engine_configs(device: str) -> list[tuple[str, str, bool]]:
    """(row name, attention backend, CUDA graphs wanted), most important first."""
    if device == "cpu":  # graphs never capture on CPU; the +graphs row runs that code path
        return [
            ("torch_native+graphs", "torch_native", True),
            ("torch_native", "torch_native", False),
            ("flashinfer+graphs", "flashinfer", True),  # skipped, with the reason shown
        ]
    return [
        ("triton+graphs", "triton", True),
        ("triton", "triton", False),
        ("flashinfer+graphs", "flashinfer", True),
        ("torch_native", "torch_native", False),
    ]


@section("engine", min_left_s=60)
def engine(run: Run) -> dict:
    from radixserve.config import LoadConfig
    from radixserve.model.loader import load_model

    start = time.perf_counter()
    load = LoadConfig(model=run.shapes.model, load_format="dummy", dtype=run.dtype,
                      device=run.device)  # fmt: skip
    run.loaded = load_model(load)
    out: dict[str, Any] = {"model": run.shapes.model, "load_s": time.perf_counter() - start}
    for name, backend, graphs in engine_configs(run.device):
        reason = skip_reason_flashinfer(run.device) if backend == "flashinfer" else None
        if reason is None and run.left() < 60:
            reason = f"out of time ({run.left():.0f}s left)"
        if reason:
            out[name] = {"skipped": reason}
            continue
        try:
            out[name] = _engine_config(run, load, backend, graphs)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        free_memory()
        print(f"  engine {name}: {out[name]}", flush=True)
    return out


def _engine_config(run: Run, load, backend: str, graphs: bool) -> dict:
    from radixserve.config import CacheConfig
    from radixserve.model.runner import ModelRunner

    s = run.shapes
    tokens = max(max(s.batches) * (s.prompt + s.new), max(s.decode_batches)
                 * (s.decode_context + 1), s.prefill_reqs * s.prefill_len)  # fmt: skip
    cache = CacheConfig(max_total_tokens=tokens + 4096, attention_backend=backend,
                        disable_cuda_graph=not graphs,
                        cuda_graph_max_bs=max(s.batches))  # fmt: skip
    start = time.perf_counter()
    runner = ModelRunner.from_loaded(run.loaded, load, cache)
    out = {"setup_s": time.perf_counter() - start, "graphs": runner.decode_graphs is not None}
    parts = {"decode_step": _decode_steps, "prefill_step": _prefill_step,
             "scheduler": _scheduler_runs}  # fmt: skip
    for part, measure in parts.items():
        try:  # a failed part keeps the others' numbers
            out[part] = measure(run, runner)
        except Exception as exc:
            out[part] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
    return out


def _decode_roofline(run: Run, runner, batch: int, context: float) -> dict:
    bandwidth = run.rate("copy_GBps")
    if not bandwidth:
        return {}
    itemsize = runner.pool.k.element_size()
    seconds = decode_bytes(runner.config, itemsize, batch, context) / (bandwidth * 1e9)
    return {"roofline_ms": seconds * 1e3}


def _with_ratio(row: dict, measured_ms: float) -> dict:
    if "roofline_ms" in row:
        row["x_roofline"] = measured_ms / row["roofline_ms"]
    return row


def _decode_steps(run: Run, runner) -> dict:
    """A bare decode step (runner.forward) of `batch` requests at decode_context tokens."""
    from radixserve.forward_batch import ForwardBatch

    s, pool, out = run.shapes, runner.pool, {}
    for batch in s.decode_batches:
        tables = [pool.extend_page_table([], s.decode_context + 1) for _ in range(batch)]
        fb = ForwardBatch.build([[1]] * batch, [s.decode_context] * batch, tables,
                                pool.page_size, run.device)  # fmt: skip
        replays = _replays(runner)
        step_ms = timed(lambda fb=fb: runner.forward(fb), run.device) * 1e3
        row = {"context": s.decode_context + 1, "step_ms": step_ms,
               "graph_replays": _replays(runner) - replays}  # fmt: skip
        row |= _decode_roofline(run, runner, batch, s.decode_context + 1)
        out[f"b{batch}"] = _with_ratio(row, step_ms)
        pool.allocator.free([p for t in tables for p in t])
    return out


def _replays(runner) -> int:
    return 0 if runner.decode_graphs is None else runner.decode_graphs.num_replays


def _prefill_step(run: Run, runner) -> dict:
    """One forward of prefill_reqs fresh prompts of prefill_len tokens, against the FLOP roof."""
    from radixserve.forward_batch import ForwardBatch

    s, pool = run.shapes, runner.pool
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, vocab, (s.prefill_reqs, s.prefill_len)).tolist()
    tables = [pool.extend_page_table([], s.prefill_len) for _ in prompts]
    fb = ForwardBatch.build(prompts, [0] * len(prompts), tables, pool.page_size, run.device)
    step_ms = timed(lambda: runner.forward(fb), run.device) * 1e3
    pool.allocator.free([p for t in tables for p in t])
    tokens = s.prefill_reqs * s.prefill_len
    row = {"tokens": tokens, "step_ms": step_ms, "tok_s": tokens / step_ms * 1e3}
    rate = run.rate("bf16_matmul_TFLOPs")
    if rate:
        flops = prefill_flops(runner.config, [s.prefill_len] * s.prefill_reqs)
        row["roofline_ms"] = flops / (rate * 1e12) * 1e3
    return _with_ratio(row, step_ms)


def _scheduler_runs(run: Run, runner) -> dict:
    from radixserve.cache.radix_cache import create_prefix_cache
    from radixserve.config import SchedulerConfig
    from radixserve.engine.scheduler import Scheduler

    s = run.shapes
    cache = create_prefix_cache(True, runner.pool.allocator, runner.pool.page_size)
    scheduler = Scheduler(runner, cache, SchedulerConfig(max_running_requests=512))
    _generate(scheduler, 2, 16, 4)  # warm-up: kernels compiled, allocator primed
    out = {}
    for batch in s.batches:
        if run.left() < 20:
            out[f"b{batch}"] = {"skipped": f"out of time ({run.left():.0f}s left)"}
            continue
        row = _generate(scheduler, batch, s.prompt, s.new)
        row |= _decode_roofline(run, runner, batch, s.prompt + s.new / 2)
        out[f"b{batch}"] = _with_ratio(row, row["decode_step_ms"])
    return out


def _generate(scheduler, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """`batch` random prompts through the real scheduler: prefill, then decode to the end."""
    vocab = scheduler.runner.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len)).tolist()
    run = greedy_run(scheduler, prompts, new_tokens)
    decode_s = max(run["decode_s"], 1e-9)
    return {
        "prefill_tok_s": batch * prompt_len / run["prefill_s"],
        "decode_tok_s": run["decode_tokens"] / decode_s,
        "decode_step_ms": decode_s / max(run["forwards"], 1) * 1e3,
        "e2e_tok_s": batch * new_tokens / (run["prefill_s"] + decode_s),
        "graph_replays": run["graph_replays"],
    }


def greedy_run(scheduler, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy `prompts` through the real scheduler, prefill (every request's first token) and
    decode timed apart: seconds, and the decode's forwards, tokens, graph replays, verify steps
    and accepted draft tokens (the scheduler's counters), and each request's tokens."""
    from radixserve.engine.request import Req
    from radixserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [Req(rid=f"r{i}", input_ids=p, params=params, seed=i) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.add_request(req)
    device = scheduler.runner.device.type
    start = time.perf_counter()
    while scheduler.inbox or scheduler.waiting or any(not r.output_ids for r in reqs):
        scheduler.step()
    sync(device)
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    stats = scheduler.stats
    counters = ("forward_steps", "decode_tokens", "spec_verify_steps", "spec_accepted_tokens")
    before = [getattr(stats, name) for name in counters] + [_replays(scheduler.runner)]
    while scheduler.has_work():
        scheduler.step()
    sync(device)
    decode_s = time.perf_counter() - start
    after = [getattr(stats, name) for name in counters] + [_replays(scheduler.runner)]
    names = ("forwards", "decode_tokens", "verify_steps", "accepted_tokens", "graph_replays")
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            **{name: a - b for name, a, b in zip(names, after, before)},
            "output_ids": [list(r.output_ids) for r in reqs]}  # fmt: skip
