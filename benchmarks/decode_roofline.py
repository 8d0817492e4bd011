"""Decode roofline: ms per decode step, torch_native vs cpu_fused, beside the memory bound.

Three rows a case: torch_native, cpu_fused (the layer modules on the fused C++ attention),
and cpu_fused+stack (the same with the C++ decode stack running the layers: what `serve`
runs on CPU by default; model/cpu_decode_stack.py).

For each batch x context case (default: batch 1, 16, 64 x context 128, 1,024, 4,096), in one
run and over the same KV pool and weights (only the runner's attention backend is swapped):
- attn ms: one layer's attention call (K/V write + attention) on a decode batch;
- step ms: one whole decode forward (all layers, LM head) of one token per request;
- roofline ms: bytes the step must read (all weights once + every request's K/V in every
  layer) over the copy bandwidth measured in this run (STREAM's convention: bytes read +
  written per second while copying a 256 MiB buffer);
- compute ms: the step's operations (gpu/gpu_roofline.py's decode_flops) over the peak rate of the
  arithmetic it uses (`--arithmetic`, default: the model dtype's: fp32 FMA for fp32 and the
  GGUF blocks' fp32 path, bf16 dot for bf16), measured in this run (compute_peaks.py);
- bound ms = max(roofline, compute), and "of bound" = bound / step (goal: >= 1 / 1.5);
- a `transformers` row: transformers' own decode step of the same config and dtype (its
  LlamaForCausalLM, sdpa, a DynamicCache of `context` random tokens per request, cropped back
  after each step), the step a user of `generate` pays (`--no-hf` leaves it out).
Backends alternate within each repetition (medians over `--repeats`), so that drift on a
shared machine hits both alike.
A second table times one layer's attention for extends (`--extend-lens` new tokens after
each of `--extend-contexts` cached ones, `--extend-batches` requests): torch_native's
gather + SDPA (plain causal SDPA over the new K/V when nothing is cached) vs cpu_fused's
paged_extend reading the prefix in place, to place cpu_fused's routing rule
(`extend_in_place`).
The pool is filled by allocation, not by a prefill (timing does not depend on KV values), so
long contexts cost no prefill. Cases whose KV exceeds --max-kv-gib are skipped and say so.
Default model: SmolLM2-135M's config with dummy weights, fp32, 1 thread.

Run:  OMP_NUM_THREADS=1 python benchmarks/decode_roofline.py [--batches 1,16,64]
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from compute_peaks import compute_peaks  # noqa: E402
from forward_micro import median_seconds  # noqa: E402
from gpu_roofline import decode_flops  # noqa: E402

from radixserve.attention import AttentionBackend  # noqa: E402
from radixserve.attention.cpu_fused import CpuFusedBackend  # noqa: E402
from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.cpu_decode_stack import Unsupported, build_decode_stack  # noqa: E402
from radixserve.model.loader import LoadedModel, load_model  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402
from radixserve.native.extension import CpuExtensionUnavailable  # noqa: E402
from radixserve.native.machine import describe_cpu  # noqa: E402

GiB = 1 << 30
COPY_BYTES = 256 << 20


@dataclass
class Row:
    batch: int
    context: int
    backend: str
    attn_ms: float | None  # None: no single layer call timed (the transformers row)
    step_ms: float
    roofline_ms: float
    read_mib: float
    compute_ms: float = 0.0  # operations over the arithmetic's measured peak

    @property
    def of_roofline(self) -> float:
        return self.roofline_ms / self.step_ms

    @property
    def bound_ms(self) -> float:
        return max(self.roofline_ms, self.compute_ms)

    @property
    def of_bound(self) -> float:
        return self.bound_ms / self.step_ms


@dataclass
class ExtendRow:
    batch: int
    context: int
    extend: int
    torch_native_ms: float
    in_place_ms: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="HF folder, .gguf or built-in config")
    p.add_argument("--load-format", default="dummy", help="auto | safetensors | gguf | dummy")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--batches", type=_int_list, default=[1, 16, 64])
    p.add_argument("--contexts", type=_int_list, default=[128, 1024, 4096])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    p.add_argument("--extend-lens", type=_int_list, default=[8, 64, 512])
    p.add_argument("--extend-batches", type=_int_list, default=[1])
    p.add_argument("--extend-contexts", type=_int_list, default=[0, 1024, 4096])
    p.add_argument("--max-kv-gib", type=float, default=4.0, help="skip cases with more KV")
    p.add_argument("--arithmetic", choices=["auto", "fp32", "bf16", "int8"], default="auto",
                   help="whose peak bounds the compute (auto: the model dtype's)")  # fmt: skip
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' own decode step")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results/decode_roofline.json"))
    return p.parse_args(argv)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by a tensor copy of COPY_BYTES (median of `repeats`)."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / median_seconds(lambda: dst.copy_(src), repeats)


def interleaved_medians(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Warms each step up, then runs them in turn `repeats` times; median seconds of each."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights a decode step reads: parameters and packed weights (buffers named
    *weight, as --cpu-dense-kernel's packed layers hold them); the embedding only when it is
    also the LM head (tied, not packed), else the step reads one row of it."""
    model = runner.model
    tensors = {id(p): p for p in model.parameters()}
    tensors |= {id(b): b for name, b in model.named_buffers() if name.endswith("weight")}
    embedding = getattr(model.embed_tokens, "weight", None)  # none: a GGUF's block embedding
    if model.lm_head is not None and embedding is not None:
        tensors.pop(id(embedding), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """K/V bytes a decode step at `context` cached tokens reads (the new token's too)."""
    shape = runner.pool.shape
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    return batch * (context + 1) * per_token * runner.pool.k.element_size()


def kv_bytes_of(loaded: LoadedModel, args: argparse.Namespace, batch: int, ctx: int) -> int:
    """kv_bytes before the runner (and its pool) exists."""
    model_dtype = LoadConfig(dtype=args.dtype).torch_dtype()
    kv_dtype = CacheConfig(kv_cache_dtype=args.kv_cache_dtype).kv_torch_dtype(model_dtype)
    return batch * (ctx + 1) * loaded.config.kv_bytes_per_token(kv_dtype)


def load(args: argparse.Namespace) -> tuple[LoadedModel, LoadConfig]:
    load_config = LoadConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device="cpu"
    )
    return load_model(load_config), load_config


def make_runner(args, loaded: LoadedModel, load_config: LoadConfig, sizes) -> ModelRunner:
    """A runner whose pool fits the largest of `sizes`: (batch, tokens per request) pairs."""
    page_size = CacheConfig().page_size
    tokens = max(b * -(-n // page_size) * page_size for b, n in sizes) + page_size
    cache_config = CacheConfig(
        max_total_tokens=tokens,
        attention_backend="torch_native",
        kv_cache_dtype=args.kv_cache_dtype,
    )
    return ModelRunner.from_loaded(loaded, load_config, cache_config)


STACKS: dict = {}  # backend name -> the decode stack its steps run (none: the modules)


def backends(runner: ModelRunner) -> dict[str, AttentionBackend]:
    """torch_native, cpu_fused, and cpu_fused+stack: cpu_fused with the C++ decode stack
    running the layers (what `serve` runs on CPU; its attn column is cpu_fused's call)."""
    found: dict[str, AttentionBackend] = {"torch_native": runner.attn}
    try:
        fused = CpuFusedBackend(runner.pool, runner.attn.sliding_window)
    except CpuExtensionUnavailable as exc:
        print(f"cpu_fused skipped: {str(exc).splitlines()[0]}")
        return found
    found["cpu_fused"] = fused
    try:
        STACKS["cpu_fused+stack"] = build_decode_stack(runner.model, fused)
        found["cpu_fused+stack"] = fused
    except Unsupported as exc:
        print(f"cpu_fused+stack skipped: {exc}")
    return found


def attention_call(backend: AttentionBackend, runner: ModelRunner, batch: ForwardBatch):
    """Layer 0's attention call on `batch`; its metadata is built once, outside, as the runner
    builds it once per step for all layers."""
    batch = dataclasses.replace(batch)  # its own attn_metadata
    backend.init_forward(batch)
    cfg = runner.config
    gen = torch.Generator().manual_seed(0)
    dtype = runner.model.norm.weight.dtype
    q = torch.randn(batch.num_tokens, cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
    kv = torch.randn(batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)

    return lambda: backend.forward(q, kv, kv, 0, batch)


def decode_step(name: str, backend: AttentionBackend, runner: ModelRunner, batch: ForwardBatch):
    def step() -> None:
        runner.attn = backend
        runner.model.decode_stack = STACKS.get(name)
        runner.forward(batch)

    return step


@torch.inference_mode()
def run_case(runner, found, batch: int, context: int, args, bandwidth: float) -> list[Row]:
    pool = runner.pool
    tables = [pool.extend_page_table([], context + 1) for _ in range(batch)]
    try:
        fb = ForwardBatch.build([[7]] * batch, [context] * batch, tables, pool.page_size)
        calls = {name: attention_call(b, runner, fb) for name, b in found.items()}
        attn = interleaved_medians(calls, args.repeats)
        steps = interleaved_medians(
            {name: decode_step(name, b, runner, fb) for name, b in found.items()}, args.repeats
        )
        read = weight_bytes(runner) + kv_bytes(runner, batch, context)
        roofline_ms, read_mib = read / bandwidth * 1e3, read / 2**20
        ms = {name: (attn[name] * 1e3, steps[name] * 1e3) for name in found}
        return [Row(batch, context, n, *ms[n], roofline_ms, read_mib) for n in found]
    finally:
        pool.allocator.free([p for t in tables for p in t])


def hf_model(loaded: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of the same HF config (random weights: timing does not depend on
    them), sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(loaded.config.hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.inference_mode()
def hf_row(model: torch.nn.Module, runner, batch: int, context: int, args, bandwidth) -> Row:
    """transformers' decode step of one token per request over `context` cached tokens."""
    from transformers import DynamicCache

    cfg, dtype = runner.config, next(model.parameters()).dtype
    cache = DynamicCache()
    shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
    for layer in range(cfg.num_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.full((batch, 1), 7)
    positions = torch.full((batch, 1), context)

    def step() -> None:
        model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drops the token the step appended

    step_ms = interleaved_medians({"transformers": step}, args.repeats)["transformers"] * 1e3
    read = weight_bytes(runner) + kv_bytes(runner, batch, context)
    return Row(batch, context, "transformers", None, step_ms, read / bandwidth * 1e3,
               read / 2**20)  # fmt: skip


@torch.inference_mode()
def extend_row(runner, found, batch: int, context: int, extend: int, args) -> ExtendRow:
    pool = runner.pool
    tables = [pool.extend_page_table([], context + extend) for _ in range(batch)]
    try:
        fb = ForwardBatch.build([[7] * extend] * batch, [context] * batch, tables, pool.page_size)
        in_place = CpuFusedBackend(pool, found["cpu_fused"].sliding_window)
        in_place.route_extend = lambda prefix_len, extend_len: True
        pair = {"torch_native": found["torch_native"], "in_place": in_place}
        ms = interleaved_medians(
            {name: attention_call(b, runner, fb) for name, b in pair.items()}, args.repeats
        )
        return ExtendRow(batch, context, extend, ms["torch_native"] * 1e3, ms["in_place"] * 1e3)
    finally:
        pool.allocator.free([p for t in tables for p in t])


def run_extends(runner, found, args) -> list[ExtendRow]:
    print("extend over a cached prefix, one layer's attention ms:")
    header = ("batch", "context", "extend", "torch_native", "in place", "speed-up")
    print("".join(f"{c:>15}" for c in header))
    rows = []
    for batch in args.extend_batches:
        for context in args.extend_contexts:
            for extend in args.extend_lens:
                r = extend_row(runner, found, batch, context, extend, args)
                rows.append(r)
                ms = (r.torch_native_ms, r.in_place_ms, r.torch_native_ms / r.in_place_ms)
                cells = (batch, context, extend, *(f"{x:.2f}" for x in ms))
                print("".join(f"{c:>15}" for c in cells), flush=True)
    return rows


COLUMNS = ("batch", "context", "backend", "attn ms", "step ms", "roofline ms", "of roofline",
           "compute ms", "bound ms", "of bound")  # fmt: skip


def print_row(r: Row) -> None:
    attn = "-" if r.attn_ms is None else f"{r.attn_ms:.2f}"
    times = (attn, f"{r.step_ms:.1f}", f"{r.roofline_ms:.1f}")
    bound = (f"{r.compute_ms:.1f}", f"{r.bound_ms:.1f}", f"{r.of_bound:.2f}")
    cells = (r.batch, r.context, r.backend, *times, f"{r.of_roofline:.2f}", *bound)
    print("".join(f"{c:>{16 if i == 2 else 13}}" for i, c in enumerate(cells)), flush=True)


def arithmetic_of(args: argparse.Namespace) -> str:
    """The arithmetic whose peak bounds the step: --arithmetic, else the model dtype's."""
    if args.arithmetic != "auto":
        return args.arithmetic
    return "bf16" if args.dtype == "bfloat16" else "fp32"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded, load_config = load(args)
    cases = [(b, c) for c in args.contexts for b in args.batches]
    limit = args.max_kv_gib * GiB
    kept = [(b, c) for b, c in cases if kv_bytes_of(loaded, args, b, c) <= limit]
    for b, c in sorted(set(cases) - set(kept)):
        print(f"skipped batch {b} context {c}: KV above --max-kv-gib {args.max_kv_gib}")
    extend_ctx = max(args.extend_contexts, default=0) + max(args.extend_lens, default=0)
    sizes = [(b, c + 1) for b, c in kept] + [(b, extend_ctx) for b in args.extend_batches]
    runner = make_runner(args, loaded, load_config, sizes)
    found = backends(runner)
    bandwidth = copy_bandwidth(5)
    peaks, arithmetic = compute_peaks(), arithmetic_of(args)
    if arithmetic not in peaks:
        raise SystemExit(f"--arithmetic {arithmetic}: torch has no such GEMM here")
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_dtype": str(runner.pool.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": describe_cpu(),
        "copy_gb_s": bandwidth / 1e9,
        "arithmetic": arithmetic,
        **{f"peak_{name}_gflop_s": rate for name, rate in peaks.items()},
        "weight_mib": weight_bytes(runner) / 2**20,
    }
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in meta.items()))
    print("".join(f"{c:>{16 if i == 2 else 13}}" for i, c in enumerate(COLUMNS)))
    rows = []
    hf = hf_model(loaded, runner.model.norm.weight.dtype) if args.hf else None
    for b, c in kept:
        case = run_case(runner, found, b, c, args, bandwidth)
        if hf is not None:
            case.append(hf_row(hf, runner, b, c, args, bandwidth))
        compute_ms = decode_flops(loaded.config, b, c) / (peaks[arithmetic] * 1e9) * 1e3
        for row in case:
            row.compute_ms = compute_ms
            rows.append(row)
            print_row(row)
    extend_rows = run_extends(runner, found, args) if "cpu_fused" in found else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    extra = [{"of_roofline": r.of_roofline, "bound_ms": r.bound_ms, "of_bound": r.of_bound}
             for r in rows]  # fmt: skip
    data = {**meta, "rows": [asdict(r) | e for r, e in zip(rows, extra)]}
    data["extend_rows"] = [asdict(r) for r in extend_rows]
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
