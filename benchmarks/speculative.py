"""Speculative decoding (NGRAM) side by side with plain decoding: single-stream greedy decode
speed and acceptance on the default model, one CPU thread by default.

Workloads: `tool_quote`, an answer that quotes a tool output from the prompt (what n-gram
drafting is for), and `free_chat`, an open-ended answer (little to look up). For each, spec
off and on run interleaved `--repeats` times; decode tok/s is measured from the first
streamed chunk to the last (prefill excluded), the median is reported, and the greedy
outputs of off and on are compared (they must be identical). Each run starts with an empty
n-gram store, so drafts come from the prompt and the answer so far only.

Run:  python benchmarks/speculative.py [--max-new-tokens 160] [--repeats 2] [--threads 1]
Prints a table and writes all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from radixserve import Engine
from radixserve.engine.speculative import create_drafter

TOOL_OUTPUT = """{"city": "Lisbon", "forecast": [
  {"day": "Monday", "high_c": 21, "low_c": 14, "sky": "sunny", "wind_kmh": 12},
  {"day": "Tuesday", "high_c": 19, "low_c": 13, "sky": "cloudy", "wind_kmh": 20},
  {"day": "Wednesday", "high_c": 17, "low_c": 12, "sky": "rain", "wind_kmh": 28}
]}"""
WORKLOADS = {
    "tool_quote": [
        {
            "role": "user",
            "content": f"Here is a JSON document:\n{TOOL_OUTPUT}\n\n"
            "Copy the JSON document above exactly, character for character.",
        }
    ],
    "free_chat": [
        {"role": "user", "content": "Write a short story about a lighthouse keeper."},
    ],
}


def decode_run(engine: Engine, prompt: str, max_new_tokens: int) -> dict:
    """One streamed greedy generation: decode tok/s after the first token, and meta_info."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    first = last = None
    final = None
    for chunk in engine.generate(prompt=prompt, sampling_params=params, stream=True):
        now = time.perf_counter()
        first = first if first is not None else now
        last, final = now, chunk
    meta = final["meta_info"]
    decode_tokens = meta["completion_tokens"] - 1  # those after the first chunk's token
    return {
        "output_ids": final["output_ids"],
        "completion_tokens": meta["completion_tokens"],
        "decode_tok_s": decode_tokens / (last - first) if last > first else 0.0,
        "spec_accept_length": meta.get("spec_accept_length"),
        "spec_accept_rate": meta.get("spec_accept_rate"),
        "spec_verify_ct": meta.get("spec_verify_ct"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--min-window", type=int, default=1, help="shortest suffix matched")
    parser.add_argument("--out", default="bench_results/speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {
        "off": Engine(args.model),
        "on": Engine(
            args.model,
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=args.num_draft_tokens,
            speculative_ngram_min_match_window_size=args.min_window,
        ),
    }
    template = engines["off"].tokenizer.apply_chat_template
    rows = []
    for name, messages in WORKLOADS.items():
        prompt = template(messages, tokenize=False, add_generation_prompt=True)
        runs = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                # a fresh n-gram store: a repeat must not draft from the run before it
                engine.scheduler.drafter = create_drafter(engine.scheduler.config)
                runs[mode].append(decode_run(engine, prompt, args.max_new_tokens))
        off, on = runs["off"][-1], runs["on"][-1]
        tok_s = {
            mode: statistics.median(r["decode_tok_s"] for r in rs) for mode, rs in runs.items()
        }
        rows.append(
            {
                "workload": name,
                "completion_tokens": on["completion_tokens"],
                "off_tok_s": tok_s["off"],
                "on_tok_s": tok_s["on"],
                "speedup": tok_s["on"] / tok_s["off"],
                "spec_accept_length": on["spec_accept_length"],
                "spec_accept_rate": on["spec_accept_rate"],
                "identical_output": off["output_ids"] == on["output_ids"],
            }
        )
    print(
        f"{'workload':>11} {'tokens':>6} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>7} "
        f"{'accept len':>10} {'accept rate':>11} {'identical':>9}"
    )
    for r in rows:
        print(
            f"{r['workload']:>11} {r['completion_tokens']:6d} {r['off_tok_s']:9.1f} "
            f"{r['on_tok_s']:9.1f} {r['speedup']:6.2f}x {r['spec_accept_length']:10.2f} "
            f"{r['spec_accept_rate']:11.2f} {str(r['identical_output']):>9}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    out.write_text(json.dumps({"args": vars(args), "info": info, "rows": rows}, indent=2))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
