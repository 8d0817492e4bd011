"""The GPU check's EAGLE3 section (check.py): the dummy-weight model of the engine section as
the target of a random EAGLE-3 head in SGLang's layout, written here at the target's shapes
(no trained head nor real weights ship to the GPU machine). Greedy through the real scheduler
at each batch: plain decoding (CUDA graphs where they capture, and eager, which a capturing
EAGLE target runs), an EAGLE3 chain and an EAGLE3 tree, always drafting. A random head's drafts
are rejected, so this measures what speculation costs on the device, not what it gains:

    step_x_plain   a speculative step's time over a plain (graph) decode step; with a trained
                   head's accept length L, EAGLE3 speeds decoding up by about L / step_x_plain
    identical      every request's greedy tokens equal plain decoding's (lossless verify)
"""

from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_engine import greedy_run
from gpu_run import Run, free_memory, section

MODES = {  # name: (scheduler speculative flags, CUDA graphs wanted)
    "plain+graphs": ({}, True),
    "plain": ({}, False),
    "eagle3 chain": ({"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                      "speculative_num_draft_tokens": 4}, False),
    "eagle3 tree": ({"speculative_num_steps": 3, "speculative_eagle_topk": 4,
                     "speculative_num_draft_tokens": 8}, False),
}  # fmt: skip
BATCHES = {"cpu": (1, 2), "cuda": (1, 16)}  # by run.device


def write_random_head(folder: Path, target, seed: int = 0) -> str:
    """A random EAGLE-3 head for `target` (its ModelConfig) as SpecForge writes one: one
    midlayer reading 2x hidden, fc over three aux layers, norm; the target's embeddings and
    LM head (no lm_head, d2t or t2d of its own)."""
    hidden, heads, kv = target.hidden_size, target.num_heads, target.num_kv_heads
    head_dim, inter = target.head_dim, target.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "fc.weight": rand(hidden, 3 * hidden),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "tie_word_embeddings": False,
    }  # fmt: skip
    layers = target.num_layers
    if layers < 8:  # SGLang's default aux layers (1, L/2 - 1, L - 4) need a deeper target
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@section("speculative", min_left_s=60)
def speculative(run: Run) -> dict:
    from radixserve.config import LoadConfig
    from radixserve.model.loader import load_model

    load = LoadConfig(model=run.shapes.model, load_format="dummy", dtype=run.dtype,
                      device=run.device)  # fmt: skip
    if run.loaded is None:  # the engine section did not run
        run.loaded = load_model(load)
    with tempfile.TemporaryDirectory() as tmp:  # not under OUT_DIR: 8B's head is ~0.9 GB
        head = write_random_head(Path(tmp) / "eagle3_head", run.loaded.config)
        batches = BATCHES["cuda" if run.device == "cuda" else "cpu"]
        return _compared(_modes(run, load, head, batches), batches)


def _modes(run: Run, load, head: str, batches: tuple[int, ...]) -> dict[str, Any]:
    prompts = torch.randint(0, run.loaded.config.vocab_size, (max(batches), run.shapes.prompt),
                            generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    out: dict[str, Any] = {"model": run.shapes.model, "new_tokens": run.shapes.new}
    for name, (flags, graphs) in MODES.items():
        if run.left() < 30:
            out[name] = {"skipped": f"out of time ({run.left():.0f}s left)"}
            continue
        try:
            out[name] = _mode(run, load, head, flags, graphs, prompts, batches)
        except Exception as exc:  # one broken mode keeps the others' numbers
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        free_memory()
        print(f"  speculative {name}: {out[name]}", flush=True)
    return out


def _mode(run: Run, load, head: str, flags: dict, graphs: bool, prompts, batches) -> dict:
    from radixserve.cache.radix_cache import create_prefix_cache
    from radixserve.config import CacheConfig, SchedulerConfig
    from radixserve.engine.scheduler import Scheduler
    from radixserve.engine.speculative import create_drafter
    from radixserve.model.runner import ModelRunner

    s = run.shapes
    cache_config = CacheConfig(max_total_tokens=max(batches) * (s.prompt + s.new + 64) + 4096,
                               attention_backend="torch_native" if run.device == "cpu"
                               else "triton", disable_cuda_graph=not graphs,
                               cuda_graph_max_bs=max(batches))  # fmt: skip
    runner = ModelRunner.from_loaded(run.loaded, load, cache_config)
    spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": head,
            "speculative_adaptive_threshold": 0.0} | flags if flags else {}  # fmt: skip
    config = SchedulerConfig(max_running_requests=max(batches), **spec)
    drafter = create_drafter(config, runner)
    cache = create_prefix_cache(True, runner.pool.allocator, runner.pool.page_size)  # off
    scheduler = Scheduler(runner, cache, config, drafter=drafter)
    _generate(scheduler, prompts[:1], 4)  # warm-up: kernels compiled, allocator primed
    row = {"graphs": runner.decode_graphs is not None}
    for batch in batches:
        row[f"b{batch}"] = _generate(scheduler, prompts[:batch], s.new)
    return row


def _generate(scheduler, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy `prompts` through the scheduler; decode speed, forwards and the tokens."""
    run = greedy_run(scheduler, prompts, new_tokens)
    seconds, verifies = max(run["decode_s"], 1e-9), run["verify_steps"]
    return {
        "decode_tok_s": run["decode_tokens"] / seconds,
        "step_ms": seconds / max(run["forwards"], 1) * 1e3,
        "forwards": run["forwards"],
        "accept_length": (run["accepted_tokens"] + verifies) / verifies if verifies else None,
        "output_ids": run["output_ids"],
    }


def _compared(out: dict, batches) -> dict:
    """Each mode's steps over plain decoding's (with graphs where they captured), and whether
    its tokens are plain decoding's; the tokens themselves are dropped from the results."""
    base = out.get("plain+graphs", {})
    if not isinstance(base.get(f"b{batches[0]}"), dict):
        base = out.get("plain", {})
    for row in out.values():
        if not isinstance(row, dict) or "error" in row or "skipped" in row:
            continue
        for batch in batches:
            key = f"b{batch}"
            mine, plain = row.get(key), base.get(key)
            if not isinstance(mine, dict) or not isinstance(plain, dict):
                continue
            mine["step_x_plain"] = mine["step_ms"] / plain["step_ms"]
            mine["identical"] = mine["output_ids"] == plain["output_ids"]
    for row in out.values():
        for part in row.values() if isinstance(row, dict) else ():
            if isinstance(part, dict):
                part.pop("output_ids", None)
    return out
