"""Cost of multi-LoRA serving: the base, one adapter for the whole batch, `--adapters`
distinct adapters mixed in one batch, and the same requests served one adapter at a time
(one call per adapter, as a server without multi-LoRA batching would), side by side.

Writes random rank-`--rank` PEFT adapters on all seven projections of the model (so no
download is needed), loads them with --lora-paths, and decodes exactly `--tokens` greedy
tokens for `--batch` prompts under each setting. Reports the median ms per decode step (one
adapter at a time: its steps summed), tokens/s (process CPU seconds beside: the machine may
be shared) over interleaved repeats and the overhead against the base; prints a table,
names the CPU and writes JSON.

Run:  python benchmarks/lora_overhead.py [--batch 8 --adapters 8 --rank 16 --tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
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


def main() -> None:
    args = parse_args()
    probe = Engine(args.model, max_total_tokens=4096)
    config = probe.runner.config
    probe.shutdown()
    with tempfile.TemporaryDirectory() as root:
        names = [f"ad{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            write_adapter(Path(root) / name, config, args.rank, seed=i)
        paths = [f"{name}={Path(root) / name}" for name in names]
        engine = Engine(args.model, max_total_tokens=16384, lora_paths=paths,
                        max_loras_per_batch=max(8, args.adapters))  # fmt: skip
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
    print(f"CPU: {describe_cpu()}  batch {args.batch}, rank {args.rank}, {args.tokens} tokens")
    print(f"{'setting':>20} {'ms/step':>9} {'cpu ms':>9} {'tokens/s':>9} {'overhead':>9}")
    for r in rows:
        print(f"{r['setting']:>20} {r['ms_per_step']:9.1f} {r['cpu_ms_per_step']:9.1f} "
              f"{r['tokens_per_s']:9.1f} {r['overhead_pct']:8.1f}%")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpu": describe_cpu(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
