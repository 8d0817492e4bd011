"""Cost of multi-LoRA serving: the base, one adapter for the whole batch, `--adapters`
distinct adapters mixed in one batch, and the same requests served one adapter at a time
(one call per adapter, as a server without multi-LoRA batching would), side by side.

Writes random rank-`--rank` PEFT adapters on all seven projections of the model (so no
download is needed), loads them with --lora-paths, and decodes exactly `--tokens` greedy
tokens for `--batch` prompts under each setting. Reports the median ms per decode step (one
adapter at a time: its steps summed), tokens/s (process CPU seconds beside: the machine may
be shared) over interleaved repeats and the overhead against the base; prints a table,
names the CPU and writes JSON. `--cpu-lora-kernel segmented torch` runs the whole table once
per kernel (the C++ segmented op vs torch's grouped matmuls, model/lora_choice.py), and
`--kernel-rows` first times the two alone on the model's four fused projections (rank
`--rank` per module, rows over two adapters) at those adapter-row counts, one thread each,
in thread CPU seconds (the best of interleaved repeats: a loaded machine slows both alike).

Run:  python benchmarks/lora_overhead.py [--batch 8 --adapters 8 --rank 16 --tokens 32]
      [--cpu-lora-kernel auto] [--kernel-rows 1 2 4 8 16 64 256 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve import Engine
from radixserve.config import ModelConfig
from radixserve.model.lora_adapter import LORA_MODULES, module_shape
from radixserve.native.machine import describe_cpu


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--cpu-lora-kernel",
        nargs="+",
        default=["auto"],
        help="one table per value (auto | segmented | torch)",
    )
    p.add_argument(
        "--kernel-rows",
        type=int,
        nargs="*",
        default=[],
        help="adapter rows at which to time the kernel alone against torch",
    )
    p.add_argument("--out", default="bench_results/lora_overhead.json")
    return p.parse_args()


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT folder with random A and B (std 0.01) on every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in LORA_MODULES:
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            fan_in, fan_out = module_shape(config, module)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                "target_modules": list(LORA_MODULES)}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def time_decode(
    engine: Engine, batch: int, tokens: int, loras: list[str | None], one_at_a_time: bool = False
) -> tuple[float, float]:
    """(wall, process CPU) seconds per decode step for `batch` prompts, request i on adapter
    loras[i]; `one_at_a_time`: one call per distinct adapter, its requests alone."""
    prompts = [f"Story {i}: Once upon a time in a small village," for i in range(batch)]
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    calls = [list(range(batch))]
    if one_at_a_time:
        calls = [[i for i in range(batch) if loras[i] == name] for name in dict.fromkeys(loras)]
    engine.flush_cache()
    start, cpu = time.perf_counter(), time.process_time()
    for call in calls:
        texts, names = [prompts[i] for i in call], [loras[i] for i in call]
        outputs = engine.generate(texts, params, lora_path=names, progress_bar=False)
        assert all(len(o["output_ids"]) == tokens for o in outputs)
    return (time.perf_counter() - start) / tokens, (time.process_time() - cpu) / tokens


def kernel_vs_torch(config: ModelConfig, rank: int, rows: list[int]) -> list[dict]:
    """The segmented C++ op against torch's grouped matmuls on the model's fused projections,
    one thread, thread CPU seconds summed over the four; a row per adapter-row count."""
    from radixserve.model.lora_choice import probe as time_both
    from radixserve.model.lora_choice import probe_shapes
    from radixserve.model.quant.dense_choice import best_times
    from radixserve.native.extension import load_cpu_ops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shapes = probe_shapes(config, rank)
        timer = partial(best_times, repeats=20, clock=time.thread_time)
        result = time_both(load_cpu_ops(), shapes, tuple(rows), time_calls=timer)
    finally:
        torch.set_num_threads(threads)
    seconds = result["seconds"]
    return [{"adapter_rows": r, "ours_over_torch": ratio, "ours_us": ours * 1e6,
             "torch_us": torch_s * 1e6}
            for r, ratio, ours, torch_s in zip(result["rows"], result["ours_over_torch"],
                                               seconds["ours"], seconds["torch"])]  # fmt: skip


def main() -> None:
    args = parse_args()
    probe = Engine(args.model, max_total_tokens=4096)
    config = probe.runner.config
    probe.shutdown()
    kernel_rows = kernel_vs_torch(config, args.rank, args.kernel_rows) if args.kernel_rows else []
    for r in kernel_rows:
        print(f"adapter rows {r['adapter_rows']:>4}: C++ segmented {r['ours_us']:8.1f} us, "
              f"torch grouped {r['torch_us']:8.1f} us, ratio {r['ours_over_torch']:.2f} "
              "(4 projections, thread CPU time, 1 thread)")  # fmt: skip
    rows = []
    for kernel in args.cpu_lora_kernel:
        rows += [dict(r, cpu_lora_kernel=kernel) for r in run_table(args, config, kernel)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "cpu": describe_cpu(), "kernel_vs_torch": kernel_rows,
              "rows": rows}  # fmt: skip
    out.write_text(json.dumps(report, indent=2))


def run_table(args: argparse.Namespace, config: ModelConfig, kernel: str) -> list[dict]:
    """The four settings' decode steps on one engine with --cpu-lora-kernel `kernel`."""
    with tempfile.TemporaryDirectory() as root:
        names = [f"ad{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(root) / name, config, args.rank, seed=i)
        paths = [f"{name}={Path(root) / name}" for name in names]
        engine = Engine(args.model, max_total_tokens=16384, lora_paths=paths,
                        max_loras_per_batch=max(8, args.adapters),
                        cpu_lora_kernel=kernel)  # fmt: skip
        mixed = [names[i % len(names)] for i in range(args.batch)]
        settings = {  # label -> (each request's adapter, one call per adapter)
            "base": ([None] * args.batch, False),
            "one adapter": ([names[0]] * args.batch, False),
            f"{args.adapters} adapters mixed": (mixed, False),
            f"{args.adapters} one at a time": (mixed, True),
        }
        time_decode(engine, args.batch, 2, mixed)  # warm up
        times: dict[str, list[tuple[float, float]]] = {label: [] for label in settings}
        for _ in range(args.repeats):  # interleaved, so that machine noise hits all alike
            for label, (loras, alone) in settings.items():
                times[label].append(time_decode(engine, args.batch, args.tokens, loras, alone))
        engine.shutdown()
    medians = {label: [statistics.median(t[k] for t in ts) for k in (0, 1)]
               for label, ts in times.items()}  # fmt: skip
    base = medians["base"][0]
    rows = [{"setting": label, "ms_per_step": wall * 1e3, "tokens_per_s": args.batch / wall,
             "cpu_ms_per_step": cpu * 1e3, "overhead_pct": (wall / base - 1) * 100}
            for label, (wall, cpu) in medians.items()]  # fmt: skip
    print(f"CPU: {describe_cpu()}  batch {args.batch}, rank {args.rank}, {args.tokens} tokens, "
          f"--cpu-lora-kernel {kernel}")  # fmt: skip
    print(f"{'setting':>20} {'ms/step':>9} {'cpu ms':>9} {'tokens/s':>9} {'overhead':>9}")
    for r in rows:
        print(f"{r['setting']:>20} {r['ms_per_step']:9.1f} {r['cpu_ms_per_step']:9.1f} "
              f"{r['tokens_per_s']:9.1f} {r['overhead_pct']:8.1f}%")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
