"""What a Gemma 3 sliding layer keeps for one long request, with and without the sliding page
space (--disable-hybrid-swa-memory): Gemma-3-4B's attention shapes (window 1024, 4 KV heads
of 256, every sixth layer global) on a 2-layer random model, so that a long prompt runs on a
CPU in seconds. Prints the sliding pages the request held and those its cached sequence
kept, and their bytes at Gemma-3-4B's bf16 K/V per token and layer.

    python benchmarks/swa_memory.py [--prompt-tokens 8192] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from radixserve import Engine

WINDOW, KV_HEADS, HEAD_DIM, PAGE = 1024, 4, 256, 16
BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16, one layer


def _model(folder: str) -> str:
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=32768,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _run(model: str, prompt: list[int], new_tokens: int, **flags) -> tuple[list[int], dict]:
    engine = Engine(model, page_size=PAGE, max_total_tokens=2 * len(prompt), **flags)
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]["output_ids"]
    engine.check_integrity()
    return out, engine.get_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    prompt = [(i * 37 + 11) % 40000 + 100 for i in range(args.prompt_tokens)]
    mib = PAGE * BYTES_PER_TOKEN / 2**20
    runs = {
        "one pool (--disable-hybrid-swa-memory)": {"disable_hybrid_swa_memory": True},
        "sliding space, defaults": {},
        "sliding space, --swa-full-tokens-ratio 0.1, --chunked-prefill-size 1024": {
            "swa_full_tokens_ratio": 0.1,
            "chunked_prefill_size": 1024,
        },
    }
    print(f"one request of {args.prompt_tokens} + {args.new_tokens} tokens, pages of {PAGE}, "
          f"{mib:.2f} MiB per page and layer (Gemma-3-4B: bf16, 4 KV heads of 256)")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        model = _model(folder)
        reference = None
        for name, flags in runs.items():
            out, stats = _run(model, prompt, args.new_tokens, **flags)
            reference = reference or out
            space = stats.get("swa_pool_capacity_pages", stats["pool_capacity_pages"])
            live = stats.get("swa_tree_live_pages", stats["tree_pages"])
            print(f"{name}: a sliding layer's space {space} pages ({space * mib:.1f} MiB); "
                  f"own pages held between steps <= {stats['max_req_sliding_pages'] or 'all'}; "
                  f"the cached sequence keeps {live} of {stats['tree_pages']} pages "
                  f"({live * mib:.1f} MiB); tombstoned {stats.get('swa_tombstoned_pages', 0)}; "
                  f"tokens {'equal' if out == reference else 'DIFFER'}")  # fmt: skip


if __name__ == "__main__":
    main()
