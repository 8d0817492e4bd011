"""Tensor-parallel scaling: prefill and decode tokens/s at each tp size, beside the per-device
decode roofline, with a correctness check against tp 1.

For each tp size (default: 1 and 2 on CPU; 1, 2, 4, 8 up to the visible GPUs on CUDA) the
runner (rank 0 of a TPModelRunner for tp > 1, gloo on CPU / nccl on CUDA) loads the same
dummy weights and runs, timed as medians over --repeats:
- prefill: one forward of --prefill-reqs x --prefill-len new tokens;
- decode: one decode step of --decode-batch requests at --context tokens each;
- all-reduce overhead: (decode step at tp - decode step at tp 1 / tp) / collectives per
  step (2 per layer, the embedding's and the logits' all-gather), an estimate of what each
  collective costs beyond perfect scaling (it also absorbs any per-rank inefficiency);
- roofline: each rank's share of the weights + KV over the copy bandwidth measured here;
- check: greedy next tokens of the prefill batch equal tp 1's, and the largest logit gap.
On 2 shared CPU cores tp 2 is expected to be slower (the point there is the overhead).

Run:  python benchmarks/tp_scaling.py [--tp-sizes 1,2] [--model NAME_OR_FOLDER] [--out F.json]
      GPU: python benchmarks/tp_scaling.py --model llama-3-8b   (bf16, Llama-3-8B shapes)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]

from gpu_roofline import decode_bytes  # noqa: E402

from radixserve.config import CacheConfig, LoadConfig, ParallelConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402
from radixserve.model.tp_runner import TPModelRunner  # noqa: E402

COPY_BYTES = 256 << 20


@dataclass
class Row:
    tp: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_ms: float
    roofline_step_ms: float
    overhead_per_collective_us: float | None
    same_tokens: bool
    max_logit_diff: float


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [int(s) for s in args.tp_sizes.split(",")] if args.tp_sizes else default_sizes()
    bandwidth = copy_bandwidth(device)
    rows, reference = [], None
    for tp in sizes:
        runner = build(args, tp, device)
        try:
            row, logits = measure(args, runner, tp, bandwidth, reference, rows)
        finally:
            if tp > 1:
                runner.close()
        reference = logits if reference is None else reference
        rows.append(row)
        print(row, flush=True)
    print_table(args, device, bandwidth, rows)
    if args.out:
        info = {"device": device, "machine": platform.machine(), "threads": args.threads}
        payload = {"args": vars(args), "info": info, "copy_gb_s": bandwidth / 1e9}
        payload["rows"] = [asdict(r) for r in rows]
        Path(args.out).write_text(json.dumps(payload, indent=2))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="built-in config or HF folder (default: llama-3-8b on CUDA, CPU_MODEL on CPU)",
    )
    p.add_argument("--tp-sizes", default=None, help="comma-separated (default: per device)")
    p.add_argument("--prefill-reqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default=None, help="JSON output path")
    return p.parse_args()


def default_sizes() -> list[int]:
    if not torch.cuda.is_available():
        return [1, 2]
    return [n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count()]


# CPU default: Llama-shaped (GQA 16/8 heads), small enough for fp32 on a laptop. The default
# SmolLM2-135M has 9 heads / 3 KV heads, which split over 3 or 9 ranks only.
CPU_MODEL = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}  # fmt: skip


def default_model(device: str) -> str:
    if device == "cuda":
        return "llama-3-8b"
    folder = Path(tempfile.mkdtemp(prefix="tp_scaling_"))
    (folder / "config.json").write_text(json.dumps(CPU_MODEL))
    return str(folder)


def build(args: argparse.Namespace, tp: int, device: str):
    model = args.model or default_model(device)
    dtype = "bfloat16" if device == "cuda" else "float32"
    load = LoadConfig(model=model, load_format="dummy", dtype=dtype, device=device)
    tokens = args.decode_batch * (args.context + 16) + args.prefill_reqs * args.prefill_len
    cache = CacheConfig(max_total_tokens=tokens + 1024, disable_cuda_graph=True)
    if tp == 1:
        return ModelRunner.create(load, cache)
    return TPModelRunner.create(load, cache, ParallelConfig(tp_size=tp))


def measure(args, runner, tp: int, bandwidth: float, reference, rows):
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, vocab, (args.prefill_reqs, args.prefill_len), generator=gen)
    prefill_s, logits = timed_prefill(runner, prompts.tolist(), args.repeats)
    decode_s = timed_decode(runner, args.decode_batch, args.context, args.repeats)
    local = runner.model.layout.local_config()
    itemsize = runner.pool.k.element_size()
    roofline = decode_bytes(local, itemsize, args.decode_batch, args.context) / bandwidth
    overhead = None
    if tp > 1 and rows:
        collectives = 2 * runner.config.num_layers + 2
        overhead = (decode_s - rows[0].decode_step_ms / 1e3 / tp) / collectives * 1e6
    same = reference is None or bool((logits.argmax(-1) == reference.argmax(-1)).all())
    diff = 0.0 if reference is None else float((logits - reference).abs().max())
    row = Row(
        tp=tp,
        prefill_tok_s=prompts.numel() / prefill_s,
        decode_tok_s=args.decode_batch / decode_s,
        decode_step_ms=decode_s * 1e3,
        roofline_step_ms=roofline * 1e3,
        overhead_per_collective_us=overhead,
        same_tokens=same,
        max_logit_diff=diff,
    )
    return row, logits


def timed_prefill(runner, prompts: list[list[int]], repeats: int):
    pool = runner.pool

    def step():
        tables = [pool.extend_page_table([], len(p)) for p in prompts]
        batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, pool.page_size, pool.device)
        out = runner.forward(batch).last
        for table in tables:
            pool.allocator.free(table)
        return out

    logits = step().cpu()
    return median_seconds(step, runner.device, repeats), logits


def timed_decode(runner, batch_size: int, context: int, repeats: int) -> float:
    """A decode step over pages that hold `context` tokens per request (their KV values do
    not change the time, so the pool is filled by allocation, not by a prefill)."""
    pool = runner.pool
    tables = [pool.extend_page_table([], context + 1) for _ in range(batch_size)]
    ids = [[1] for _ in range(batch_size)]
    batch = ForwardBatch.build(ids, [context] * batch_size, tables, pool.page_size, pool.device)
    seconds = median_seconds(lambda: runner.forward(batch), runner.device, repeats)
    for table in tables:
        pool.allocator.free(table)
    return seconds


def median_seconds(step, device: torch.device, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second copying a 256 MiB buffer (STREAM's convention)."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), torch.device(device), 5)
    return 2 * COPY_BYTES / seconds


COLUMNS = (
    "tp", "prefill tok/s", "decode tok/s", "decode step ms", "roofline ms", "us/collective",
    "same tokens", "max logit diff",
)  # fmt: skip


def print_table(args, device: str, bandwidth: float, rows: list[Row]) -> None:
    gb_s = bandwidth / 1e9
    print(f"\ntp scaling on {device} ({args.threads} thread(s) per rank), copy {gb_s:.1f} GB/s")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        over = r.overhead_per_collective_us
        cells = (
            r.tp, f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}", f"{r.decode_step_ms:.2f}",
            f"{r.roofline_step_ms:.2f}", "-" if over is None else f"{over:.0f}", r.same_tokens,
            f"{r.max_logit_diff:.1e}",
        )  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
