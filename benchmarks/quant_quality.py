"""Quantization quality: every `--quantization` against its reference on one model, on CPU.

A mode is a `--quantization` value with optional suffixes: `:g64` (int4's
`--quantization-group-size`), `:head` (`--quantize-lm-head`), `:act-int8` / `:act-fp32`
(`--cpu-quant-activation`: the GGUF block layers' activations), `:kernels`
(`--enable-deterministic-inference`: every row count on the row-invariant kernels, so the
teacher-forced windows score the arithmetic a decode step runs, not prefill's dense path);
e.g. `int4:g128:head`, `auto:act-int8:kernels`.
For each mode (`--modes`), through the real serving path (Engine.generate):
- perplexity over a fixed public-domain text (benchmarks/data/), teacher-forced in windows of
  `--window` tokens that start every `--stride` tokens; each token is scored once, in the first
  window that has it past the previous window's end (so with at least window - stride context);
- top-1 agreement: the fraction of those positions whose argmax next token equals fp32's;
- greedy agreement on the first `--num-prompts` CHAT_PROMPTS (chat template applied): the
  fraction of prompts whose first `--greedy-tokens` greedy tokens equal the reference's, the
  mean length of the common prefix, and that prefix as a fraction of the reference's tokens.
The reference is mode none with dtype float32: fp32 for a dense checkpoint; for a GGUF file
(the default model is a Q4_1 one) the file's own quantization, its blocks dequantized to
fp32. Every mode's target: perplexity within `PPL_LIMIT` (1%) of the reference's.

Run:  python benchmarks/quant_quality.py [--modes none,int8] [--max-tokens 1024]
Writes a table and the targets (met / missed) to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixserve import Engine
from radixserve.config import LoadConfig
from radixserve.native.machine import describe_cpu

TEXT = Path(__file__).parent / "data" / "public_domain_prose.txt"
DEFAULT_MODES = "none,int8,int8:head,int4,int4:g64,int4:head,gguf"
REFERENCE = "none"  # run in float32: the reference every agreement is measured against
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "Explain what photosynthesis is in one sentence.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue?",
)
PPL_LIMIT = 0.01  # issue #31: every quantization within 1% perplexity of its reference


@dataclass
class Row:
    mode: str
    reference: str  # what the agreements and the perplexity target compare with
    dtype: str
    load_s: float
    eval_s: float
    num_scored_tokens: int
    perplexity: float
    top1_agreement: float
    greedy_agreement: float
    greedy_common_prefix: float
    greedy_prefix_fraction: float  # common prefix / the reference's tokens, per prompt, mean


@dataclass
class ModeRun:
    """One mode's outputs over the text and the prompts, before comparison with fp32."""

    dtype: str
    load_s: float
    eval_s: float
    logprobs: list[float]  # one per scored text position
    argmax: list[int]  # the top-1 next token at each scored position
    greedy: list[list[int]]  # output ids per chat prompt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2 GGUF)")
    p.add_argument("--modes", default=DEFAULT_MODES, help="quantization modes, comma-separated")
    p.add_argument(
        "--dtype", default="auto", help="dtype of the quantized modes (auto: fp32, bf16 kernels)"
    )
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (32|64|128)")
    p.add_argument("--text", type=Path, default=TEXT, help="plain text to score")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens per scoring window")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    p.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=4, help="chat prompts (at most 8)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/quant_quality.json"))
    return p.parse_args(argv)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: positions [first_scored, end) are scored in it."""
    spans, scored_until, start = [], 1, 0
    while scored_until < num_tokens:
        end = min(start + window, num_tokens)
        spans.append((start, end, scored_until))
        scored_until, start = end, start + stride
    return spans


def score_text(engine: Engine, ids: list[int], args: argparse.Namespace) -> tuple[list, list]:
    """Log-probability of each text token given the ones before, and the top-1 prediction."""
    logprobs, argmax = [], []
    for start, end, first in windows(len(ids), args.window, args.stride):
        meta = engine.generate(
            input_ids=ids[start:end],
            sampling_params={"max_new_tokens": 0, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )["meta_info"]
        offset = first - start
        logprobs += [e[0] for e in meta["input_token_logprobs"][offset:]]
        argmax += [top[0][1] for top in meta["input_top_logprobs"][offset:]]
    return logprobs, argmax


def chat_prompts(engine: Engine, num_prompts: int) -> list[str]:
    render = engine.tokenizer.apply_chat_template
    messages = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS[:num_prompts]]
    return [render(m, add_generation_prompt=True, tokenize=False) for m in messages]


def greedy_outputs(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    params = {"max_new_tokens": args.greedy_tokens, "temperature": 0}
    outs = engine.generate(chat_prompts(engine, args.num_prompts), sampling_params=params)
    return [out["output_ids"] for out in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def dtype_label(mode: str, dtype: str) -> str:
    """The model dtype, and the int kernels' where they differ (auto: float32/bf16)."""
    load = LoadConfig(device="cpu", quantization=mode, dtype=dtype)
    model = str(load.torch_dtype()).removeprefix("torch.")
    kernels = str(load.quant_compute_dtype()).removeprefix("torch.")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[kernels]
    return model if mode in (REFERENCE, "none") or kernels == model else f"{model}/{short}"


def mode_options(spec: str, default_group_size: int | None = None) -> dict:
    """`int4:g64:head` -> the Engine's quantization keyword arguments."""
    method, *suffixes = spec.split(":")
    group_size = default_group_size if method == "int4" else None
    options = {"quantization": method, "quantization_group_size": group_size}
    for suffix in suffixes:
        if suffix == "head":
            options["quantize_lm_head"] = True
        elif suffix.startswith("g") and suffix[1:].isdigit():
            options["quantization_group_size"] = int(suffix[1:])
        elif suffix in ("act-int8", "act-fp32"):
            options["cpu_quant_activation"] = suffix.removeprefix("act-")
        elif suffix == "kernels":
            options["enable_deterministic_inference"] = True
        else:
            raise ValueError(
                f"mode {spec!r}: suffixes are :g<group size>, :head, :act-int8, :act-fp32 "
                "and :kernels"
            )
    return options


def reference_label(model: str | None) -> str:
    """What mode none in fp32 is for this model: fp32, or a GGUF file's own blocks."""
    if model is None or model.endswith(".gguf"):
        return "the file's quantization (fp32 dequant)"
    return "fp32"


def run_mode(args: argparse.Namespace, mode: str) -> ModeRun:
    dtype = "float32" if mode == REFERENCE else args.dtype
    start = time.perf_counter()
    options = mode_options(mode, args.group_size)
    engine = Engine(args.model, dtype=dtype, device="cpu", **options)
    dtype = dtype_label(options["quantization"], dtype)
    load_s = time.perf_counter() - start
    try:
        ids = text_ids(engine, args)
        logprobs, argmax = score_text(engine, ids, args)
        greedy = greedy_outputs(engine, args)
    finally:
        engine.shutdown()
    eval_s = time.perf_counter() - start - load_s
    return ModeRun(dtype, load_s, eval_s, logprobs, argmax, greedy)


def compare(mode: str, reference: str, scored: ModeRun, ref: ModeRun) -> Row:
    """The mode's quality row, its agreements measured against the reference run."""
    top1 = mean([float(a == b) for a, b in zip(scored.argmax, ref.argmax)])
    prefixes = [common_prefix(a, b) for a, b in zip(scored.greedy, ref.greedy)]
    fractions = [p / max(len(b), 1) for p, b in zip(prefixes, ref.greedy)]
    same = [float(a == b) for a, b in zip(scored.greedy, ref.greedy)]
    ppl = math.exp(-mean(scored.logprobs))
    n = len(scored.logprobs)
    times = (scored.load_s, scored.eval_s)
    greedy = (mean(same), mean(prefixes), mean(fractions))
    return Row(mode, reference, scored.dtype, *times, n, ppl, top1, *greedy)


def targets(rows: list[Row]) -> list[dict]:
    """Each mode's perplexity target: the relative excess over the reference, met or missed."""
    ref = rows[0]
    found = []
    for row in rows[1:]:
        excess = row.perplexity / ref.perplexity - 1
        name = f"{row.mode} perplexity within {PPL_LIMIT:.0%} of {ref.reference}"
        met = excess <= PPL_LIMIT
        found.append({"target": name, "excess": excess, "limit": PPL_LIMIT, "met": met})
    return found


COLUMNS = (
    "mode",
    "dtype",
    "vs ref",
    "load s",
    "eval s",
    "tokens",
    "ppl",
    "top-1 agr",
    "greedy agr",
    "prefix",
    "prefix frac",
)


def print_row(cells) -> None:
    print(" ".join(f"{c:>12}" for c in cells), flush=True)


def format_row(r: Row, ref_ppl: float) -> tuple:
    return (
        r.mode,
        r.dtype,
        f"{r.perplexity / ref_ppl - 1:+.2%}",
        f"{r.load_s:.1f}",
        f"{r.eval_s:.1f}",
        r.num_scored_tokens,
        f"{r.perplexity:.3f}",
        f"{r.top1_agreement:.3f}",
        f"{r.greedy_agreement:.3f}",
        f"{r.greedy_common_prefix:.1f}",
        f"{r.greedy_prefix_fraction:.2f}",
    )


def text_ids(engine: Engine, args: argparse.Namespace) -> list[int]:
    """The text as the model's tokenizer writes it, cut to `--max-tokens`."""
    ids = engine.tokenizer.encode(args.text.read_text(encoding="utf-8"))
    return ids[: args.max_tokens]


def evaluate(args: argparse.Namespace, modes: list[str]) -> list[Row]:
    rows, ref, label = [], None, reference_label(args.model)
    for mode in modes:
        scored = run_mode(args, mode)
        ref = ref or scored
        rows.append(compare(mode, label, scored, ref))
        print_row(format_row(rows[-1], rows[0].perplexity))
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    modes = [REFERENCE] + [m for m in args.modes.split(",") if m != REFERENCE]
    meta = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": describe_cpu(),
        "reference": reference_label(args.model),
    }
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print_row(COLUMNS)
    rows = evaluate(args, modes)
    found = targets(rows)
    for t in found:
        verdict = "met" if t["met"] else "MISSED"
        print(f"target: {t['target']}: {t['excess']:+.2%} -> {verdict}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    data = {**meta, "args": settings, "rows": [asdict(r) for r in rows], "targets": found}
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
