"""Decode step of a mixture-of-experts model against a dense model of the same active size.

Both models share attention, embeddings and depth; the MoE model's MLP is `--experts`
experts of `--moe-inter` columns with top-`--top-k` routing (Qwen3-MoE's layout), the dense
model's one MLP of top_k * moe_inter columns: the same parameters per token, so the gap
between them is what routing, grouping and reading more expert weights cost. Weights are
random (`--load-format dummy`, seeded), so routing spreads tokens over the experts much
as a trained router's load balancing does.

Attention and the LM head run on the layers `--cpu-dense-kernel` picks (our packed kernel
where a once-per-machine probe finds it faster); fp experts always on torch's matmul, so
`--cpu-dense-kernel torch` compares like with like. `--quantization int8 | int4` quantizes
both models on load: the dense model's MLP is then one int layer, the MoE model's each
expert's own (model/moe.py `use_expert_layers`: one Python call per expert that got rows).

A decode step: after an untimed prefill of `--context-len` tokens per request, one forward
of one new token per request (forward_micro.py's `rs_decode`: median of `--steps` steps).

Run:  python benchmarks/moe_decode.py [--batches 1,16] [--experts 32 --top-k 4]
Writes a table to stdout (with the CPU) and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from forward_micro import random_prompts, rs_decode

from radixserve.config import CacheConfig, LoadConfig, ModelConfig
from radixserve.model.llama import hf_weight_shapes
from radixserve.model.runner import ModelRunner
from radixserve.native.machine import describe_cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=384, help="columns of one expert")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps (median)")
    p.add_argument(
        "--cpu-dense-kernel",
        default="auto",
        help="the dense model's fp layers: auto | torch | packed (experts run torch's matmul)",
    )
    p.add_argument("--quantization", default="none", help="none | int8 | int4 (both models)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/moe_decode.json"))
    return p.parse_args(argv)


def hf_configs(args: argparse.Namespace) -> dict[str, dict]:
    """config.json of the MoE model and of its dense twin (same active parameters)."""
    heads = args.hidden // 64
    common = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    moe = common | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": args.top_k * args.moe_inter,
        "moe_intermediate_size": args.moe_inter,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
    }
    dense = common | {
        "architectures": ["Qwen3ForCausalLM"],
        "intermediate_size": args.top_k * args.moe_inter,
    }
    return {"moe": moe, "dense": dense}


def make_runner(folder: Path, hf_config: dict, args: argparse.Namespace) -> ModelRunner:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    pages = max(args.batches) * (-(-(args.context_len + args.steps + 2) // 16))
    return ModelRunner.create(
        LoadConfig(
            model=str(folder),
            load_format="dummy",
            device="cpu",
            dtype=args.dtype,
            cpu_dense_kernel=args.cpu_dense_kernel,
            quantization=args.quantization,
        ),
        CacheConfig(page_size=16, max_total_tokens=(pages + 1) * 16),
    )


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(all parameters, those one token uses): the unrouted experts are the difference."""
    total = sum(torch.Size(shape).numel() for shape in hf_weight_shapes(config).values())
    if config.moe is None:
        return total, total
    moe = config.moe
    unused = (moe.num_experts - moe.top_k) * 3 * moe.intermediate_size * config.hidden_size
    return total, total - unused * len(moe.sparse_layers)


def measure(runner: ModelRunner, args: argparse.Namespace) -> dict[int, float]:
    """Median decode-step seconds per batch size."""
    gen = torch.Generator().manual_seed(0)
    seconds = {}
    for batch in args.batches:
        prompts = random_prompts(gen, batch, args.context_len, args.vocab)
        steps = random_prompts(gen, args.steps + 1, batch, args.vocab)
        seconds[batch] = rs_decode(runner, prompts, steps)
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in hf_configs(args).items():
            runner = make_runner(Path(tmp) / name, config, args)
            total, active = parameter_counts(runner.config)
            kernel = type(runner.model.layers[0].self_attn.qkv_proj).__name__
            results[name] = {"params": total, "active": active, "linear": kernel}
            results[name]["step_s"] = measure(runner, args)
            del runner
    cpu = describe_cpu()
    threads = torch.get_num_threads()
    print(f"# MoE decode vs dense of equal active parameters ({cpu}, {args.dtype}, {threads} thr)")
    print(
        f"# {args.experts} experts, top-{args.top_k}, {args.moe_inter} columns each, "
        f"--quantization {args.quantization}"
    )
    print("| model | params | active | fp layers | batch | step ms | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for batch, s in r["step_s"].items():
            sizes = f"{r['params'] / 1e6:.0f}M | {r['active'] / 1e6:.0f}M | {r['linear']}"
            print(f"| {name} | {sizes} | {batch} | {s * 1e3:.2f} | {batch / s:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    report = {"cpu": cpu, "threads": threads, "args": settings, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
