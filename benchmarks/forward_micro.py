"""Micro-benchmark: tokens/s of one model forward, radixserve vs HF transformers.

Measures, for the default model (SmolLM2-135M-Instruct) on CPU unless told otherwise:

- prefill: one forward over `batch` random prompts of `--prompt-len` tokens each;
  tokens/s = batch * prompt_len / time.
- decode: after an untimed prefill of `--context-len` tokens per request, one forward of a
  single new token per request; tokens/s = batch / time (successive steps, so the context
  grows by one token per step).

Each case runs once to warm up, then `--repeats` times; the median time is reported. Only
the forward itself is timed (batch construction is not). transformers gets the same token
ids as an unpadded [batch, len] tensor, the same weights (the converted HF folder) and
dtype, and `logits_to_keep=1`, since radixserve also computes only the last logits.
Built-in configs with dummy weights (e.g. `--model llama-3-8b --load-format dummy`) have
no HF folder, so their transformers column reads n/a.

Run:  python benchmarks/forward_micro.py [--prefill-batches 1,4,16] [--decode-batches 1,16,64]
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.runner import ModelRunner

Prompts = list[list[int]]
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


@dataclass
class Row:
    phase: str
    batch: int
    tokens: int
    context_len: int
    radixserve_s: float
    radixserve_tok_s: float
    transformers_s: float | None
    transformers_tok_s: float | None

    @property
    def ratio(self) -> float | None:
        if self.transformers_tok_s is None:
            return None
        return self.radixserve_tok_s / self.transformers_tok_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder, .gguf, or built-in config name")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prefill prompt")
    p.add_argument("--context-len", type=int, default=128, help="cached tokens before decode")
    p.add_argument("--prefill-batches", type=_int_list, default=[1, 4, 16])
    p.add_argument("--decode-batches", type=_int_list, default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    p.add_argument("--no-transformers", action="store_true", help="skip the HF column")
    p.add_argument("--out", type=Path, default=Path("bench_results/forward_micro.json"))
    return p.parse_args(argv)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def median_seconds(step: Callable[[], None], repeats: int) -> float:
    """Runs `step` once to warm up, then `repeats` times; median wall time in seconds."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_prompts(gen: torch.Generator, batch: int, length: int, vocab: int) -> Prompts:
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def pool_tokens(args: argparse.Namespace, page_size: int) -> int:
    """KV pool capacity that fits the largest case, rounded up to whole pages per request."""
    decode_len = args.context_len + args.repeats + 1
    cases = [(b, args.prompt_len) for b in args.prefill_batches]
    cases += [(b, decode_len) for b in args.decode_batches]
    return max(b * -(-n // page_size) * page_size for b, n in cases) + page_size


# radixserve


def allocate(runner: ModelRunner, batch: int, length: int) -> list[list[int]]:
    return [runner.pool.extend_page_table([], length) for _ in range(batch)]


def release(runner: ModelRunner, tables: list[list[int]]) -> None:
    runner.pool.allocator.free([p for table in tables for p in table])


def build(
    runner: ModelRunner, ids: Prompts, prefix_len: int, tables: list[list[int]]
) -> ForwardBatch:
    prefix_lens = [prefix_len] * len(ids)
    return ForwardBatch.build(ids, prefix_lens, tables, runner.pool.page_size, runner.device)


def rs_prefill(runner: ModelRunner, prompts: Prompts, repeats: int) -> float:
    tables = allocate(runner, len(prompts), len(prompts[0]))
    try:
        batch = build(runner, prompts, 0, tables)
        return median_seconds(lambda: runner.forward(batch), repeats)
    finally:
        release(runner, tables)


def rs_decode(runner: ModelRunner, prompts: Prompts, steps: Prompts) -> float:
    """Prefills `prompts` (untimed), then times one decode forward per column of `steps`."""
    context_len = len(prompts[0])
    tables = allocate(runner, len(prompts), context_len + len(steps))
    try:
        runner.forward(build(runner, prompts, 0, tables))
        times = []
        for i, step in enumerate(steps):
            batch = build(runner, [[t] for t in step], context_len + i, tables)
            start = time.perf_counter()
            runner.forward(batch)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        release(runner, tables)


# transformers


def load_hf_model(loaded: LoadedModel, dtype: torch.dtype) -> Any | None:
    if loaded.tokenizer_path is None:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(loaded.tokenizer_path), dtype=dtype)
    return model.eval()


def hf_prefill(model: Any, prompts: Prompts, repeats: int) -> float:
    ids = torch.tensor(prompts, dtype=torch.int64)

    @torch.inference_mode()
    def step() -> None:
        model(ids, use_cache=False, logits_to_keep=1)

    return median_seconds(step, repeats)


def cache_kwarg(model: Any) -> str:
    """KV-cache argument and output name: `cache` in newer transformers, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_decode(model: Any, prompts: Prompts, steps: Prompts) -> float:
    key = cache_kwarg(model)
    out = model(torch.tensor(prompts, dtype=torch.int64), use_cache=True, logits_to_keep=1)
    times = []
    for step in steps:
        ids = torch.tensor(step, dtype=torch.int64)[:, None]
        start = time.perf_counter()
        out = model(ids, use_cache=True, **{key: getattr(out, key)})
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# cases


@dataclass
class Bench:
    args: argparse.Namespace
    runner: ModelRunner
    hf: Any | None
    vocab: int
    gen: torch.Generator


def prefill_row(ctx: Bench, batch: int) -> Row:
    prompts = random_prompts(ctx.gen, batch, ctx.args.prompt_len, ctx.vocab)
    rs = rs_prefill(ctx.runner, prompts, ctx.args.repeats)
    hf = hf_prefill(ctx.hf, prompts, ctx.args.repeats) if ctx.hf is not None else None
    tokens = batch * ctx.args.prompt_len
    return make_row("prefill", batch, tokens, 0, rs, hf)


def decode_row(ctx: Bench, batch: int) -> Row:
    prompts = random_prompts(ctx.gen, batch, ctx.args.context_len, ctx.vocab)
    steps = random_prompts(ctx.gen, ctx.args.repeats + 1, batch, ctx.vocab)
    rs = rs_decode(ctx.runner, prompts, steps)
    hf = hf_decode(ctx.hf, prompts, steps) if ctx.hf is not None else None
    return make_row("decode", batch, batch, ctx.args.context_len, rs, hf)


def make_row(phase: str, batch: int, tokens: int, context: int, rs: float, hf: float | None) -> Row:
    hf_tok_s = tokens / hf if hf is not None else None
    return Row(phase, batch, tokens, context, rs, tokens / rs, hf, hf_tok_s)


# output


def header(name: str, load_config: LoadConfig) -> dict[str, Any]:
    import transformers

    return {
        "model": name,
        "device": str(load_config.torch_device()),
        "dtype": str(load_config.torch_dtype()).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


COLUMNS = ("phase", "batch", "tokens", "radixserve tok/s", "transformers tok/s", "ratio")
WIDTHS = (-8, 6, 8, 18, 20, 8)


def print_line(cells: tuple[Any, ...]) -> None:
    pairs = zip(cells, WIDTHS, strict=True)
    line = "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in pairs)
    print(line, flush=True)


def print_row(r: Row) -> None:
    rs, hf = format(r.radixserve_tok_s, ".1f"), _fmt(r.transformers_tok_s, ".1f")
    print_line((r.phase, r.batch, r.tokens, rs, hf, _fmt(r.ratio, ".2f")))


def write_json(path: Path, meta: dict[str, Any], args: argparse.Namespace, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    data = {**meta, "args": settings, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_config = LoadConfig(model=args.model, load_format=args.load_format, dtype=args.dtype)
    loaded = load_model(load_config)
    cache_config = CacheConfig(max_total_tokens=pool_tokens(args, CacheConfig().page_size))
    runner = ModelRunner.from_loaded(loaded, load_config, cache_config)
    hf = None if args.no_transformers else load_hf_model(loaded, load_config.torch_dtype())
    gen = torch.Generator().manual_seed(0)
    ctx = Bench(args, runner, hf, loaded.config.vocab_size, gen)
    meta = header(loaded.name, load_config)
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print_line(COLUMNS)
    rows = []
    cases = [(prefill_row, b) for b in args.prefill_batches]
    for make, batch in cases + [(decode_row, b) for b in args.decode_batches]:
        rows.append(make(ctx, batch))
        print_row(rows[-1])
    write_json(args.out, meta, args, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
