"""One chat stream's decode speed, radixserve beside llama.cpp's own server, in one run.

The issue's single-stream goals (CPU serving speed): fp32 decode at least at parity with
`llama-server` on the same F32 weights, and int4 (the default model's Q4_1 GGUF as shipped)
at least at parity with `llama-server` on that file. Every system is started once (one slot,
the same threads: OMP_NUM_THREADS, else every core), then the rounds take turns: each round
sends every system the same fresh prompt (seeded random words, so no system hits a cache),
one request at a time, greedy with EOS ignored, and times its stream.

    decode tok/s = (output tokens - 1) / (last token's time - first token's time)

    prefill tok/s = prompt tokens / time to the first token

Medians over the rounds; ratios are radixserve's over its peer at the same weights.
`--model` takes any GGUF (e.g. one of radixserve_bench.realistic_gguf's): both `radixserve`
and `llama-server` then serve that very file (the default systems become those two; the
fp32 pair needs an F32 GGUF converted from the dequantized weights, default model only).

Run:  OMP_NUM_THREADS=2 python benchmarks/single_stream.py [--prompt-lens 128,1024]
      [--output-len 128] [--rounds 3] [--systems radixserve-fp32,llama-server-f32,...]
      [--model path/to/file.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from pathlib import Path

from radixserve.model.tokenizer import model_tokenizer
from radixserve.native.machine import describe_cpu
from radixserve_bench.backends import make_backend
from radixserve_bench.client import bench_session
from radixserve_bench.record import RequestResult
from radixserve_bench.systems import LaunchOptions, launch, parse_systems, unavailable_reason
from radixserve_bench.text import TextSource

PEERS = {"radixserve-fp32": "llama-server-f32", "radixserve": "llama-server"}
"""radixserve system -> the llama-server system on the same weights."""
DEFAULT_SYSTEMS = "radixserve-fp32,llama-server-f32,radixserve,llama-server"
MODEL_SYSTEMS = "radixserve,llama-server"
"""With --model: both systems on the file itself."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--systems", default=None, help=f"default: {DEFAULT_SYSTEMS}; with --model: {MODEL_SYSTEMS}"
    )
    p.add_argument("--model", default=None, help="any GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-lens", default="128,1024")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server-args", default="--no-repack",
                   help="extra llama-server flags (--no-repack: its AMX Q4_1 path crashes on "
                   "some Xeons, see docs/performance.md)")  # fmt: skip
    p.add_argument("--server-args", default="", help="extra radixserve serve flags")
    p.add_argument("--out", type=Path, default=Path("bench_results/single_stream.json"))
    return p.parse_args(argv)


def decode_tok_s(result: RequestResult) -> float | None:
    """Tokens after the first over the time between the first and the last."""
    if not result.success or len(result.chunk_times) < 2:
        return None
    span = result.chunk_times[-1] - result.chunk_times[0]
    return (sum(result.chunk_tokens) - result.chunk_tokens[0]) / span if span > 0 else None


async def one_request(backend, prompt: list[int], output_len: int) -> RequestResult:
    result = RequestResult(index=0, prompt_ids=prompt)
    async with bench_session() as session:
        await backend.generate(session, prompt, output_len, result)
    return result


def run(args: argparse.Namespace) -> dict:
    specs = parse_systems(args.systems or (MODEL_SYSTEMS if args.model else DEFAULT_SYSTEMS))
    options = LaunchOptions(
        model=args.model,
        server_args=args.server_args,
        llama_server_args=args.llama_server_args,
    )
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    text = TextSource(model_tokenizer(args.model), random.Random(args.seed))
    rounds = [[text.tokens(n) for n in prompt_lens] for _ in range(args.rounds)]
    skipped = {s.name: r for s in specs if (r := unavailable_reason(s, options))}
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    servers = {}
    log_dir = Path(tempfile.mkdtemp(prefix="single_stream_"))
    try:
        max_seq_len = max(prompt_lens) + args.output_len + 16
        for spec in (s for s in specs if s.name not in skipped):
            server = launch(spec, options, max_batch=1, log_dir=log_dir, max_seq_len=max_seq_len)
            backend = make_backend(spec.backend, server.url, None, args.model, None)
            servers[spec.name] = (spec, server, backend)
        for prompts in rounds:  # systems take turns inside every round
            for prompt in prompts:
                for name, (_, _, backend) in servers.items():
                    result = asyncio.run(one_request(backend, prompt, args.output_len))
                    if (tok_s := decode_tok_s(result)) is None:
                        raise RuntimeError(f"{name}: request failed: {result.error}")
                    samples.setdefault((name, len(prompt)), []).append((result.ttft, tok_s))
    finally:
        for _, server, _ in servers.values():
            server.stop()
    return report(specs, servers, samples, prompt_lens, skipped, args)


def report(specs, servers, samples, prompt_lens, skipped, args) -> dict:
    rows = []
    for spec in specs:
        for n in prompt_lens:
            if (spec.name, n) not in samples:
                continue
            ttfts, rates = zip(*samples[(spec.name, n)])
            row = {"system": spec.name, "weights": spec.weights, "prompt_len": n}
            ttft = statistics.median(ttfts)
            row |= {"ttft_s": ttft, "prefill_tok_s": n / ttft if ttft > 0 else None}
            row |= {"decode_tok_s": statistics.median(rates), "rounds": len(rates)}
            rows.append(row)
    by_key = {(r["system"], r["prompt_len"]): r for r in rows}
    for row in rows:
        peer = by_key.get((PEERS.get(row["system"]), row["prompt_len"]))
        row["vs_peer"] = row["decode_tok_s"] / peer["decode_tok_s"] if peer else None
        row["prefill_vs_peer"] = _ratio(row["prefill_tok_s"], peer and peer["prefill_tok_s"])
    machine = describe_cpu()
    print(machine)
    print(f"model: {args.model or 'default'}")
    print(f"{'system':<18} {'weights':<13} {'prompt':>6} {'TTFT s':>7} {'prefill tok/s':>13} "
          f"{'decode tok/s':>12} {'decode, prefill vs llama-server':>31}")  # fmt: skip
    for r in rows:
        ratios = ", ".join(f"{v:.2f}x" if v else "-" for v in (r["vs_peer"], r["prefill_vs_peer"]))
        print(f"{r['system']:<18} {r['weights']:<13} {r['prompt_len']:>6} {r['ttft_s']:>7.2f} "
              f"{r['prefill_tok_s'] or 0:>13.1f} {r['decode_tok_s']:>12.1f} "
              f"{ratios:>31}")  # fmt: skip
    for name, reason in skipped.items():
        print(f"{name}: skipped: {reason}")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine}
    out |= {"rows": rows, "skipped": skipped}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


if __name__ == "__main__":
    run(parse_args())
