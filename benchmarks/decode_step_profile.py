"""Where one decode step's time goes: model matmuls, attention, other ops, and the host.

Drives a real `EngineCore` (the scheduler the server and `Engine.generate` step) with
`--batch` greedy requests of `--context` prompt tokens until they all decode, then times
`--steps` decode steps twice:
- plain (no profiler): ms per `scheduler.step()`, and inside it the model forward
  (`runner.forward`), batch building (`batches.build`) and sampling (`sampler.sample_each`),
  as CPU time of the stepping thread (`time.thread_time`: with one torch thread all the work
  runs on it, and time spent descheduled on a shared machine does not count);
- under torch.profiler: each op's self time, grouped into matmuls (the projections, MLP and
  LM head: the weights read), attention (the KV read) and other ops (norms, rotary, SiLU,
  embedding, copies). What no op accounts for is Python and the interpreter.
The profiled split (fractions of the profiled forward) is scaled to the plain forward time,
so the profiler's own cost is dropped.

`--torch-compile both` runs each batch eagerly and then with --enable-torch-compile, side
by side, and reports the one-off compile time of the batch's padded size (`compile_s`).
`--layer-ops both` likewise runs each batch without, then with the fused C++ CPU layer ops.
`--q4k-layouts x8,rows` builds each engine twice, alternated like `--quantization`: Q4_K /
Q6_K / Q4_0 / Q4_1 layers on int8 activations repacked 8 rows at a time (x8: what serving does
on AVX-512) and kept in the file's row layout (rows: the int8 kernel before the repack); the
same bits, so only the time differs. Rows print as e.g. `auto:rows`.
`--top-ops N` also prints the N ops of most self time per step, by op and input shapes (so
each projection, and the LM head, shows as its own line).
`--quantization none,int4` builds one engine per method and alternates their plain passes
(`--rounds` times, median per method; a loaded machine slows both alike), then profiles
each; `x first` is the first method's step time over this one's (int4's speed-up over fp32).

Run:  OMP_NUM_THREADS=1 python benchmarks/decode_step_profile.py [--quantization none]
Prints a table; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve.config import CacheConfig, LoadConfig, SchedulerConfig
from radixserve.engine.core import EngineCore
from radixserve.engine.request import Req
from radixserve.model.quant.activation_choice import REPACKABLE
from radixserve.native.machine import describe_cpu
from radixserve.sampling.params import SamplingParams

MATMUL_OPS = ("mm", "addmm", "bmm", "matmul", "linear", "_weight_int4pack_mm", "_weight_int8")
BLOCK_MATMUL_OPS = (  # our C++ matmuls (GGUF blocks, K-quants, the packed dense kernel)
    "radixserve_cpu::int4_block_mm",
    "radixserve_cpu::int8_block_mm",
    "radixserve_cpu::kquant_mm",
    "radixserve_cpu::int4_block_mm_q8",  # the same blocks with int8 activations
    "radixserve_cpu::int4_x8_mm_q8",  # Q4_0 / Q4_1 repacked 8 rows at a time
    "radixserve_cpu::int8_block_mm_q8",
    "radixserve_cpu::kquant_mm_q8",
    "radixserve_cpu::dense_mm",
)
ATTENTION_OPS = ("radixserve_cpu::paged_", "scaled_dot_product", "_flash_attention")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--quantization", default="none",
                   help="none | auto (the default: gguf) ..., or several, comma-separated, "
                   "run alternately")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="alternating plain passes per method")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per pass")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--torch-compile", choices=("off", "on", "both"), default="off")
    p.add_argument("--layer-ops", choices=("off", "on", "both"), default="on",
                   help="the fused C++ CPU layer ops (model/cpu_layer_ops.py); both: each "
                   "batch with them off, then on, side by side")  # fmt: skip
    p.add_argument(
        "--cpu-quant-kernels",
        default="auto",
        help="comma-separated --cpu-quant-kernel values run side by side (e.g. torch,auto)",
    )
    p.add_argument(
        "--cpu-quant-activations",
        default="auto",
        help="comma-separated --cpu-quant-activation values run side by side (e.g. fp32,int8)",
    )
    p.add_argument(
        "--cpu-dense-kernels",
        default="auto",
        help="comma-separated --cpu-dense-kernel values run side by side (e.g. torch,packed)",
    )
    p.add_argument("--q4k-layouts", default="x8",
                   help="comma-separated: x8 (serving's), rows (Q4_K never repacked)")  # fmt: skip
    p.add_argument("--top-ops", type=int, default=0,
                   help="print the N ops of most self time, by input shapes")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results/decode_step_profile.json"))
    return p.parse_args(argv)


class Timers:
    """Wraps methods so that each call's wall time adds to a named list."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock
        self.seconds: dict[str, list[float]] = {}
        self.wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, method: str, name: str) -> None:
        inner: Callable = getattr(owner, method)

        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds.setdefault(name, []).append(self.clock() - start)

        setattr(owner, method, timed)
        self.wrapped.append((owner, method))

    def unwrap(self) -> None:
        """Back to the classes' own methods."""
        for owner, method in self.wrapped:
            delattr(owner, method)
        self.wrapped.clear()

    def median_ms(self, name: str) -> float:
        return statistics.median(self.seconds.get(name, [0.0])) * 1e3


def build_core(
    args: argparse.Namespace,
    batch: int,
    compiled: bool,
    kernel: str,
    dense: str,
    acts: str,
    quantization: str,
) -> EngineCore:
    quantization, _, layout = quantization.partition(":")
    load = LoadConfig(
        model=args.model,
        quantization=quantization,
        device="cpu",
        cpu_quant_kernel=kernel,
        cpu_quant_activation=acts,
        cpu_dense_kernel=dense,
    )
    tokens = batch * (args.context + (args.rounds + 3) * args.steps + 64) + 1024
    cache = CacheConfig(
        max_total_tokens=tokens,
        attention_backend=args.attention_backend,
        enable_torch_compile=compiled,
    )
    if layout != "rows":
        return EngineCore.build(load, cache, SchedulerConfig())
    saved = {cls: cls.can_repack for cls in REPACKABLE}
    for cls in REPACKABLE:  # this engine's Q4_K / Q6_K / Q4_0 / Q4_1 stay in rows
        cls.can_repack = lambda self: False
    try:
        return EngineCore.build(load, cache, SchedulerConfig())
    finally:
        for cls, can_repack in saved.items():
            cls.can_repack = can_repack


def add_requests(core: EngineCore, batch: int, args: argparse.Namespace) -> None:
    tokens = (args.rounds + 3) * args.steps + 8  # every pass's steps, and the profiled one
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 131 + j * 17) % 4000 + 200 for j in range(args.context)]
        core.scheduler.add_request(Req(rid=f"r{i}", input_ids=ids, params=params, seed=0))


def until_all_decode(core: EngineCore) -> None:
    scheduler = core.scheduler
    scheduler.step()  # drains the inbox into the waiting queue
    while scheduler.waiting or any(r.is_prefilling for r in scheduler.running):
        scheduler.step()
    scheduler.step()  # one plain decode step, to warm up


def plain_pass(core: EngineCore, steps: int) -> dict[str, float]:
    timers = Timers()
    scheduler = core.scheduler
    timers.wrap(scheduler, "step", "step")
    timers.wrap(scheduler.runner, "forward", "forward")
    timers.wrap(scheduler.batches, "build", "build_batch")
    timers.wrap(scheduler.sampler, "sample_each", "sample")
    for _ in range(steps):
        scheduler.step()
    timers.unwrap()
    names = ("step", "forward", "build_batch", "sample")
    return {name: timers.median_ms(name) for name in names}


def profiled_pass(core: EngineCore, steps: int, top_ops: int = 0) -> dict[str, Any]:
    """Self ms per step of matmul, attention and other ops, and the forward's ms per step,
    all wall time under the profiler (its op times are wall times); with `top_ops`, also
    the ops of most self time by input shapes (`top_ops`: [{op, shapes, ms}])."""
    timers = Timers(time.perf_counter)
    timers.wrap(core.scheduler.runner, "forward", "forward")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=top_ops > 0) as prof:
        for _ in range(steps):
            core.scheduler.step()
    split = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        name = event.key.removeprefix("aten::")
        if (
            name in MATMUL_OPS
            or any(name.startswith(m) for m in MATMUL_OPS[5:])
            or event.key in BLOCK_MATMUL_OPS
        ):
            split["matmul"] += ms
        elif any(a in event.key for a in ATTENTION_OPS):
            split["attention"] += ms
        else:
            split["other_ops"] += ms
    split["forward"] = statistics.mean(timers.seconds["forward"]) * 1e3
    timers.unwrap()
    if top_ops:
        split["top_ops"] = largest_ops(prof, steps, top_ops)
    return split


def largest_ops(prof, steps: int, num: int) -> list[dict[str, Any]]:
    """The `num` (op, input shapes) of most self time, in ms per step."""
    events = sorted(prof.key_averages(group_by_input_shape=True),
                    key=lambda e: e.self_cpu_time_total, reverse=True)  # fmt: skip
    return [{"op": e.key, "shapes": str(e.input_shapes), "ms": e.self_cpu_time_total / 1e3 / steps}
            for e in events[:num]]  # fmt: skip


def breakdown(plain: dict[str, float], prof: dict[str, float]) -> dict[str, float]:
    """The step in ms: op groups as their share of the profiled forward times the plain
    forward, the rest of the forward as Python, and the scheduler's own time (outside the
    forward) split into batch building, sampling and the rest."""
    to_plain = plain["forward"] / prof["forward"]
    scaled = {k: prof[k] * to_plain for k in ("matmul", "attention", "other_ops")}
    host = plain["step"] - plain["forward"]
    return {
        "step": plain["step"],
        **scaled,
        "forward_python": plain["forward"] - sum(scaled.values()),
        "build_batch": plain["build_batch"],
        "sample": plain["sample"],
        "scheduler_other": host - plain["build_batch"] - plain["sample"],
    }


def compile_seconds(core: EngineCore) -> float:
    """Seconds the compiled sizes took to compile (0 when eager)."""
    compiled = core.scheduler.runner.compiled_decode
    return sum(compiled.compile_seconds.values()) if compiled is not None else 0.0


COLUMNS = ("step", "matmul", "attention", "other_ops", "forward_python", "build_batch",
           "sample", "scheduler_other", "compile_s", "x_first")  # fmt: skip


def alternate_plain(cores: dict[str, EngineCore], steps: int, rounds: int) -> dict[str, dict]:
    """Each core's plain pass, the cores taking turns `rounds` times: the median per key."""
    passes: dict[str, list[dict[str, float]]] = {q: [] for q in cores}
    for _ in range(rounds):
        for quantization, core in cores.items():
            passes[quantization].append(plain_pass(core, steps))
    return {
        q: {k: statistics.median(p[k] for p in runs) for k in runs[0]} for q, runs in passes.items()
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    layouts = ["" if layout == "x8" else f":{layout}" for layout in args.q4k_layouts.split(",")]
    quantizations = [q + layout for q in args.quantization.split(",") for layout in layouts]
    print(f"quantization={args.quantization} context={args.context} threads={args.threads}")
    print("ms per decode step")
    choices = {"off": [False], "on": [True], "both": [False, True]}
    runs = [
        (c, f, k, d, a)
        for c in choices[args.torch_compile]
        for f in choices[args.layer_ops]
        for k in args.cpu_quant_kernels.split(",")
        for d in args.cpu_dense_kernels.split(",")
        for a in args.cpu_quant_activations.split(",")
    ]
    header = f"{'quant':>10}{'batch':>6}{'compiled':>9}{'layer_ops':>10}{'kernel':>8}{'dense':>7}"
    header += f"{'acts':>6}"
    print(header + "".join(f"{c:>16}" for c in COLUMNS))
    for batch in [int(b) for b in args.batches.split(",")]:
        for compiled, layer_ops, kernel, dense, acts in runs:
            cores = {}
            for quantization in quantizations:
                core = build_core(args, batch, compiled, kernel, dense, acts, quantization)
                cores[quantization] = core
                if not layer_ops:
                    core.runner.model.use_cpu_layer_ops(None)
                add_requests(core, batch, args)
            with torch.inference_mode():
                for core in cores.values():
                    until_all_decode(core)
                plains = alternate_plain(cores, args.steps, args.rounds)
                profs = {q: profiled_pass(c, args.steps, args.top_ops) for q, c in cores.items()}
            first_step = None
            for quantization, core in cores.items():
                plain, prof = plains[quantization], profs[quantization]
                row = {"quantization": quantization, "batch": batch, "compiled": compiled}
                row["layer_ops"] = layer_ops
                row["cpu_quant_kernel"] = kernel
                row["cpu_dense_kernel"] = dense
                row["cpu_quant_activation"] = acts
                row |= breakdown(plain, prof)
                row["compile_s"] = compile_seconds(core)
                first_step = first_step or row["step"]
                row["x_first"] = first_step / row["step"]
                rows.append(row)
                cells = "".join(f"{row[c]:>16.2f}" for c in COLUMNS)
                prefix = f"{quantization:>10}{batch:>6}{compiled!s:>9}{layer_ops!s:>10}"
                print(prefix + f"{kernel:>8}{dense:>7}{acts:>6}" + cells, flush=True)
                for op in prof.get("top_ops", []):
                    row.setdefault("top_ops", []).append(op)
                    print(f"{'':>8}{op['ms']:>9.2f} ms  {op['op']}  {op['shapes']}")
                core.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"quantization": args.quantization, "context": args.context, "threads": args.threads}
    meta |= {"rounds": args.rounds, "cpu": describe_cpu(), "clock": "thread CPU time"}
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
