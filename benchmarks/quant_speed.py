"""Quantization speed: none / int8 / int4 (/ gguf) side by side on one model, CPU by default.

For each case (`--cases`, each `quantization:dtype`, or `quantization:dtype:deterministic` for
--enable-deterministic-inference, which keeps prefill on the int kernels), in one run:
- load: seconds to load and quantize the model; weights: MiB of parameters and buffers;
- prefill: one forward over one prompt of `--prefill-len` tokens; tokens/s;
- decode bs=1 and bs=16: after an untimed prefill of `--context-len` tokens per request,
  one forward of one new token per request; tokens/s = batch / median step time.
Only forwards are timed (forward_micro.py's method: warm-up, then the median).

Run:  python benchmarks/quant_speed.py [--threads 1] [--cases none:float32,int4:bfloat16]
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward_micro import random_prompts, rs_decode, rs_prefill  # noqa: E402

from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402
from radixserve.model.quant.quantize import weight_bytes  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402

DEFAULT_CASES = "none:float32,none:bfloat16,int8:bfloat16,int4:bfloat16,gguf:bfloat16"


@dataclass
class Row:
    quantization: str
    dtype: str
    weights_mib: float
    load_s: float
    prefill_tok_s: float
    decode_bs1_tok_s: float
    decode_bs16_tok_s: float
    deterministic: bool = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2 GGUF)")
    p.add_argument("--cases", default=DEFAULT_CASES, help="quantization:dtype, comma-separated")
    p.add_argument("--context-len", type=int, default=128, help="tokens before decode")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill")
    p.add_argument("--batch", type=int, default=16, help="batch of the batched decode row")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps (median)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefill runs (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/quant_speed.json"))
    return p.parse_args(argv)


def run_case(args: argparse.Namespace, quantization: str, dtype: str, det: bool) -> Row:
    load_config = LoadConfig(
        model=args.model,
        device="cpu",
        quantization=quantization,
        dtype=dtype,
        enable_deterministic_inference=det,
    )
    start = time.perf_counter()
    loaded = load_model(load_config)
    load_s = time.perf_counter() - start
    tokens = max(args.batch * (args.context_len + args.steps + 16), args.prefill_len + 16)
    runner = ModelRunner.from_loaded(loaded, load_config, CacheConfig(max_total_tokens=tokens))
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prefill = rs_prefill(runner, random_prompts(gen, 1, args.prefill_len, vocab), args.repeats)
    decode = [
        batch
        / rs_decode(
            runner,
            random_prompts(gen, batch, args.context_len, vocab),
            random_prompts(gen, args.steps + 1, batch, vocab),
        )
        for batch in (1, args.batch)
    ]
    mib = weight_bytes(loaded.model) / 2**20
    return Row(quantization, dtype, mib, load_s, args.prefill_len / prefill, *decode, det)


COLUMNS = (
    "quantization",
    "dtype",
    "weights MiB",
    "load s",
    "prefill tok/s",
    "decode bs1",
    "decode bs16",
)


def print_row(cells) -> None:
    print("".join(f"{c:>14}" for c in cells), flush=True)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print_row(COLUMNS)
    rows = []
    for case in args.cases.split(","):
        quantization, dtype, *flags = case.split(":")
        rows.append(run_case(args, quantization, dtype, "deterministic" in flags))
        r = rows[-1]
        print_row(
            (
                r.quantization + (" (det.)" if r.deterministic else ""),
                r.dtype,
                f"{r.weights_mib:.0f}",
                f"{r.load_s:.1f}",
                f"{r.prefill_tok_s:.0f}",
                f"{r.decode_bs1_tok_s:.1f}",
                f"{r.decode_bs16_tok_s:.1f}",
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    data = {**meta, "args": settings, "rows": [asdict(r) for r in rows]}
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
