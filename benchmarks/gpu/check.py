"""GPU device check: correctness and speed of everything GPU-side in one run, against rooflines.

Sections (each one skipped with a reason when a dependency is missing or time runs short):
  1. device: copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s), the rooflines' rates
  2. kernels: Triton decode (eager and CUDA-graph chunking) / extend vs their torch references
     at batch 64 x 4k context of Llama-3-8B heads, timed as % of the copy bandwidth; FlashInfer's
     decode beside them when it is installed
     quant_kernels: Triton int4 / int8 dequant-GEMMs vs their references, timed beside a bf16
     matmul and torch's int8 kernel, M=1 and 512, weights 576x1536 and 4096x4096 (gpu_quant.py)
     model_kernels: Triton fused MoE, segmented multi-LoRA, extend with draft trees and with
     soft-capping, each vs its torch reference (gpu_model_kernels.py)
  3. engine: dummy-weight Llama-3-8B in bf16 per attention backend, with and without CUDA
     graphs: the real scheduler at batch 1/16/64/256 (prefill tok/s, decode tok/s, decode step
     vs its roofline), a bare decode step at batch 1 and 64 x 4k context, an 8k-token prefill step
  4. shared_prefix: the shared-prefix bench's small preset, radix cache vs none
  5. transformers: HF `generate` on the same shape at batch 1 and 64
  6. tensor_parallel: only where more than one GPU is visible: benchmarks/tp_scaling.py on
     dummy Llama-3-8B at tp 1/2/4/8 (nccl), prefill / decode tok/s against the per-device
     roofline, greedy tokens checked against tp 1
Prints the tables and the targets last (gpu_report.py); writes every number as JSON into
OUT_DIR after each section, so a run cut short still leaves what it measured.

Run:  bash benchmarks/gpu/check.sh OUT_DIR            (GPU machine: torch, triton, transformers)
      python benchmarks/gpu/check.py OUT_DIR --smoke  (CPU: tiny shapes, checks the script)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]  # a plain checkout: nothing installed
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU, slowly

from gpu_model_kernels import model_kernel_rows  # noqa: E402
from gpu_quant import quant_matmul_rows  # noqa: E402
from gpu_report import summary_text  # noqa: E402
from gpu_roofline import decode_bytes, prefill_flops  # noqa: E402

RESULTS: dict[str, Any] = {}


@dataclass(frozen=True)
class Shapes:
    model: str
    batches: tuple[int, ...]  # scheduler runs
    prompt: int
    new: int
    decode_batches: tuple[int, ...]  # bare decode steps at decode_context
    decode_context: int
    prefill_reqs: int  # one prefill step of prefill_reqs x prefill_len tokens
    prefill_len: int
    kernel: tuple[int, int, int, int, int, int, int]  # reqs, seq, page, heads, kv_heads, dim, ext
    graph_context: int  # positions a decode graph covers (Llama-3-8B: 8192)
    hf_batches: tuple[int, ...]
    shared_prefix: dict[str, int] | None  # overrides of the bench's small preset
    quant_weights: tuple[tuple[int, int], ...]  # (out, in) of the quantized matmuls
    quant_m: tuple[int, ...]  # their activation rows: decode, prefill


FULL = Shapes("llama-3-8b", (1, 16, 64, 256), 512, 64, (1, 64), 4096, 8, 1024,
              (64, 4096, 16, 32, 8, 128, 512), 8192, (1, 64), None,
              ((576, 1536), (4096, 4096)), (1, 512))  # fmt: skip
SMOKE = Shapes("tiny-llama", (1, 4), 32, 8, (1, 4), 48, 2, 16, (2, 40, 16, 4, 2, 16, 8), 128,
               (1, 4), dict(num_groups=2, prompts_per_group=2, system_len=48, question_len=8,
                            output_len=4), ((40, 128), (48, 256)), (1, 17))  # fmt: skip
TINY_LLAMA = {  # --smoke: a dummy-weight model small enough for the CPU
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@dataclass
class Run:
    device: str
    shapes: Shapes
    out_dir: Path
    deadline: float
    loaded: Any = None  # the dummy model, shared by the engine and shared-prefix sections
    notes: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        return "float32" if self.device == "cpu" else "bfloat16"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def rate(self, key: str) -> float | None:
        """A rate measured by the device section (None if it failed)."""
        return RESULTS.get("device", {}).get(key)


def section(name: str, min_left_s: float):
    """Runs a section unless less than `min_left_s` remains; records its numbers or error."""

    def wrap(fn):
        def run(ctx: Run) -> None:
            start = time.perf_counter()
            if ctx.left() < min_left_s:
                RESULTS[name] = {"skipped": f"out of time ({ctx.left():.0f}s left)"}
            else:
                try:
                    RESULTS[name] = fn(ctx)
                except Exception as exc:  # one broken section must not hide the rest
                    RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
            print(f"[{name}] {time.perf_counter() - start:.1f}s: {RESULTS[name]}", flush=True)
            write_json(ctx.out_dir)

        return run

    return wrap


def write_json(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds per fn(): triton's do_bench on CUDA (mean after warm-up, L2 flushed between
    calls); on CPU, where only the script itself is under test, one call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def skip_reason_flashinfer(device: str) -> str | None:
    if device != "cuda":
        return "flashinfer needs CUDA"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer not installed (pip install flashinfer-python)"
    return None


# ---- 1. device ---------------------------------------------------------------------------


@section("device", min_left_s=10)
def device_rates(run: Run) -> dict:
    n = (1 << 20) if run.device == "cpu" else (1 << 28)  # bf16 elements: 512 MiB per buffer
    src = torch.empty(n, dtype=torch.bfloat16, device=run.device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), run.device)
    size = 256 if run.device == "cpu" else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=run.device)
    mm_s = timed(lambda: a @ a, run.device)
    return {"copy_GBps": 2 * n * 2 / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * size**3 / mm_s / 1e12}


# ---- 2. kernels --------------------------------------------------------------------------


def _paged(num_reqs, seq_len, page_size, heads, kv_heads, dim, device, dtype):
    pages = -(-seq_len // page_size)
    perm = torch.randperm(num_reqs * pages, device=device) + 1
    table = perm.view(num_reqs, pages)
    slots = (num_reqs * pages + 1) * page_size
    k = torch.randn(slots, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((num_reqs,), seq_len, device=device)
    return table, k, v, lens


@section("kernels", min_left_s=30)
def kernels(run: Run) -> dict:
    from radixserve.attention.triton_backend import graph_decode_splits
    from radixserve_kernels import paged_decode, paged_extend, reference

    reqs, seq, ps, heads, kv_heads, dim, ext = run.shapes.kernel
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    table, k, v, lens = _paged(reqs, seq, ps, heads, kv_heads, dim, run.device, dtype)
    q = torch.randn(reqs, heads, dim, device=run.device, dtype=dtype)
    want = reference.paged_decode_attention_ref(q, k, v, table, lens, ps).float()
    kv_bytes = 2 * reqs * seq * kv_heads * dim * k.element_size()
    out = {"shape": f"{reqs} reqs x {seq} ctx, {heads}/{kv_heads} heads x {dim}"}

    def decode_stats(name: str, fn) -> None:
        seconds = timed(fn, run.device)
        out[f"{name}_max_abs_err"] = (fn().float() - want).abs().max().item()
        out[f"{name}_ms"] = seconds * 1e3
        out[f"{name}_GBps"] = kv_bytes / seconds / 1e9

    decode_stats("decode", lambda: paged_decode.paged_decode_attention(q, k, v, table, lens, ps))
    splits, split_len = graph_decode_splits(run.shapes.graph_context)  # as a decode graph does
    decode_stats("decode_graph", lambda: paged_decode.paged_decode_attention(
        q, k, v, table, lens, ps, split_len=split_len, num_splits=splits))  # fmt: skip
    reason = skip_reason_flashinfer(run.device)
    if reason:
        out["flashinfer"] = f"skipped: {reason}"
    else:
        decode_stats("flashinfer_decode", _flashinfer_decode(q, k, v, table, lens, ps))
    qe = torch.randn(reqs * ext, heads, dim, device=run.device, dtype=dtype)
    starts = torch.arange(reqs, device=run.device) * ext
    prefix, extend = lens - ext, torch.full_like(lens, ext)
    run_ext = lambda: paged_extend.paged_extend_attention(  # noqa: E731
        qe, k, v, table, starts, prefix, extend, ext, ps)  # fmt: skip
    want_ext = reference.paged_extend_attention_ref(
        qe, k, v, table, prefix.tolist(), extend.tolist(), ps)  # fmt: skip
    out["extend_max_abs_err"] = (run_ext().float() - want_ext.float()).abs().max().item()
    ext_s = timed(run_ext, run.device)
    out["extend_ms"] = ext_s * 1e3
    out["extend_TFLOPs"] = 4 * reqs * ext * seq * heads * dim / ext_s / 1e12
    return out


def _flashinfer_decode(q, k, v, table, lens, ps):
    """FlashInfer's decode over the same pages, planned once (as the backend does per step)."""
    from radixserve.attention.flashinfer_backend import import_flashinfer, paged_kv_plan_inputs

    flashinfer = import_flashinfer()
    reqs, heads, dim = q.shape
    kv_heads = k.shape[1]
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=heads // kv_heads >= 4
    )
    inputs = paged_kv_plan_inputs(table, lens.tolist(), [1] * reqs, ps)
    wrapper.plan(inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, heads, kv_heads,
                 dim, ps, q_data_type=q.dtype, kv_data_type=k.dtype)  # fmt: skip
    pages = (-1, ps, kv_heads, dim)
    return lambda: wrapper.run(q, (k.view(pages), v.view(pages)))


@section("quant_kernels", min_left_s=30)
def quant_kernels(run: Run) -> dict:
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    s = run.shapes
    return quant_matmul_rows(s.quant_weights, s.quant_m, run.device, dtype,
                             lambda fn: timed(fn, run.device))  # fmt: skip


@section("model_kernels", min_left_s=30)
def model_kernels(run: Run) -> dict:
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    smoke = run.shapes.model != FULL.model
    return model_kernel_rows(run.device, dtype, smoke, lambda fn: timed(fn, run.device))


# ---- 3. engine ---------------------------------------------------------------------------


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
    from radixserve.engine.request import Req
    from radixserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    vocab, device = scheduler.runner.config.vocab_size, scheduler.runner.device.type
    reqs = [Req(rid=f"r{i}", input_ids=torch.randint(0, vocab, (prompt_len,)).tolist(),
                params=params, seed=i) for i in range(batch)]  # fmt: skip
    for req in reqs:
        scheduler.add_request(req)
    start = time.perf_counter()
    while scheduler.inbox or scheduler.waiting or any(not r.output_ids for r in reqs):
        scheduler.step()
    sync(device)
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    stats, replays = scheduler.stats, _replays(scheduler.runner)
    steps, decoded = stats.forward_steps, stats.decode_tokens
    while scheduler.has_work():
        scheduler.step()
    sync(device)
    decode_s = max(time.perf_counter() - start, 1e-9)
    steps, decoded = stats.forward_steps - steps, stats.decode_tokens - decoded
    return {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": decoded / decode_s,
        "decode_step_ms": decode_s / max(steps, 1) * 1e3,
        "e2e_tok_s": batch * new_tokens / (prefill_s + decode_s),
        "graph_replays": _replays(scheduler.runner) - replays,
    }


# ---- 4. shared prefix --------------------------------------------------------------------


class WordTokenizer:
    """Stands in for a real tokenizer (none ships on the GPU machine): a stable id per word."""

    def __init__(self, vocab_size: int):
        self.low = min(1000, vocab_size // 2)
        self.span = vocab_size - self.low

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.low + zlib.crc32(word.encode()) % self.span for word in text.split()]


@section("shared_prefix", min_left_s=45)
def shared_prefix(run: Run) -> dict:
    from radixserve.config import CacheConfig, LoadConfig
    from radixserve.model.runner import ModelRunner
    from radixserve_bench.hit_rate import max_hit_rate
    from radixserve_bench.workloads import make_workload

    if run.loaded is None:
        return {"skipped": "the engine section did not load the model"}
    tokenizer = WordTokenizer(run.loaded.config.vocab_size)
    workload = make_workload("shared-prefix", tokenizer, 0, "small", run.shapes.shared_prefix)
    prompts = workload.prompts()
    output_len = workload.requests[0].output_len
    load = LoadConfig(model=run.shapes.model, load_format="dummy", dtype=run.dtype,
                      device=run.device)  # fmt: skip
    tokens = sum(len(p) + output_len for p in prompts) + 4096
    cache = CacheConfig(max_total_tokens=tokens, cuda_graph_max_bs=len(prompts))
    runner = ModelRunner.from_loaded(run.loaded, load, cache)
    rows = {name: _serve(runner, prompts, output_len, disable) for name, disable
            in (("radix", False), ("none", True))}  # fmt: skip
    optimum = max_hit_rate(prompts, runner.pool.page_size)
    same = rows["radix"].pop("output_ids") == rows["none"].pop("output_ids")
    return {
        "workload": f"{len(prompts)} prompts, " + ", ".join(
            f"{k}={v}" for k, v in workload.config.items() if k not in ("seed",)),
        "max_hit_rate": optimum,
        "radix": rows["radix"] | {"hit_rate_of_max": rows["radix"]["hit_rate"] / optimum},
        "none": rows["none"],
        "speedup": rows["none"]["wall_s"] / rows["radix"]["wall_s"],
        "same_outputs": same,
    }  # fmt: skip


def _serve(runner, prompts: list[list[int]], output_len: int, disable_cache: bool) -> dict:
    from radixserve.cache.radix_cache import create_prefix_cache
    from radixserve.config import SchedulerConfig
    from radixserve.engine.request import Req
    from radixserve.engine.scheduler import Scheduler
    from radixserve.sampling.params import SamplingParams

    cache = create_prefix_cache(disable_cache, runner.pool.allocator, runner.pool.page_size)
    scheduler = Scheduler(runner, cache, SchedulerConfig())
    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    reqs = [Req(rid=f"p{i}", input_ids=p, params=params, seed=i) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.has_work():
        scheduler.step()
    sync(runner.device.type)
    wall = time.perf_counter() - start
    stats = scheduler.stats
    cache.reset()  # hand the pages back for the next system
    return {
        "wall_s": wall,
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "hit_rate": stats.cache_hit_rate,
        "output_tok_s": sum(len(r.output_ids) for r in reqs) / wall,
        "output_ids": [r.output_ids for r in reqs],
    }


# ---- 5. transformers ---------------------------------------------------------------------


@section("transformers", min_left_s=45)
def transformers_generate(run: Run) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    run.loaded = None  # the engine's copy of the weights goes before HF's arrives
    free_memory()
    cfg = model_config_dict(run.shapes.model)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    with torch.device(run.device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.eval()
    s, out = run.shapes, {}
    for batch in s.hf_batches:
        if run.left() < 20:
            out[f"b{batch}_tok_s"] = f"skipped: out of time ({run.left():.0f}s left)"
            continue
        ids = torch.randint(0, config.vocab_size, (batch, s.prompt), device=run.device)
        with torch.inference_mode():
            _hf_generate(model, ids[:, :16], 2)  # warm-up
            sync(run.device)
            start = time.perf_counter()
            _hf_generate(model, ids, s.new)
            sync(run.device)
            out[f"b{batch}_tok_s"] = batch * s.new / (time.perf_counter() - start)
    return out


def _hf_generate(model, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy, exactly `new_tokens` new tokens per row (no early stop)."""
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip


# ---- main --------------------------------------------------------------------------------


def import_kernels_package() -> None:
    """Makes this checkout's radixserve_kernels/ the one imported, installed or not (an
    installed one may be another checkout's)."""
    spec = importlib.util.spec_from_file_location(
        "radixserve_kernels", ROOT / "radixserve_kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "radixserve_kernels")],
    )  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["radixserve_kernels"] = module
    spec.loader.exec_module(module)


def model_config_dict(model: str) -> dict[str, Any]:
    """The HF config of a built-in config name or of a model folder."""
    from radixserve.model.source import builtin_config

    folder = Path(model)
    if folder.is_dir():
        return json.loads((folder / "config.json").read_text())
    return builtin_config(model)


def smoke_shapes(out_dir: Path) -> Shapes:
    """SMOKE, its tiny model written as a config-only HF folder (dummy weights) in out_dir."""
    folder = out_dir / "tiny-llama"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return replace(SMOKE, model=str(folder))


@section("tensor_parallel", min_left_s=90)
def tensor_parallel(ctx: Run) -> dict[str, Any]:
    """benchmarks/tp_scaling.py in its own process (its ranks are spawned processes)."""
    import subprocess

    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible; tensor parallelism needs 2 or more"}
    sizes = ",".join(str(n) for n in (1, 2, 4, 8) if n <= gpus)
    out = ctx.out_dir / "tp_scaling.json"
    script = ROOT / "benchmarks" / "tp_scaling.py"
    cmd = [sys.executable, str(script), "--model", ctx.shapes.model, "--tp-sizes", sizes]
    cmd += ["--repeats", "3", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=max(ctx.left() - 10, 30))
    return json.loads(out.read_text())


def main() -> None:
    import_kernels_package()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--budget-s", type=float, default=440.0,
                        help="start no work after this many seconds (check.sh: 470)")  # fmt: skip
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(args.out_dir)
    shapes = smoke_shapes(out_dir) if args.smoke else FULL
    run = Run(device, shapes, out_dir, time.perf_counter() + args.budget_s)
    RESULTS["env"] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu {platform.machine()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": "smoke" if args.smoke else "full",
    }
    steps = (
        device_rates, kernels, quant_kernels, model_kernels, engine, shared_prefix,
        transformers_generate, tensor_parallel,
    )  # fmt: skip
    for step in steps:
        step(run)
    RESULTS["total_s"] = args.budget_s - run.left()
    write_json(run.out_dir)
    print(summary_text(RESULTS))


if __name__ == "__main__":
    main()
