"""What a GGUF file is: its reader, metadata fields, and the HF-style config of the model it
holds (a llama one; Qwen3-MoE, Qwen2-MoE and Mixtral: their MoE fields from gguf_moe.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.model.gguf_file import GGUFFile
from radixserve.model.quant.gguf_moe import GGUF_ARCHITECTURES, moe_hf_fields
from radixserve.model.source import ModelLoadError


def read_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as exc:  # a bad file fails in many ways (struct, enum, OS errors)
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_hf_config(reader, path: Path) -> dict[str, Any]:
    """An HF-style config dict from the metadata of a llama GGUF, or of an MoE one (qwen3moe,
    qwen2moe, llama with experts: gguf_moe.py)."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"--quantization gguf reads {', '.join(GGUF_ARCHITECTURES)} GGUF files; {path} is "
            f"{arch!r} (use --quantization none)"
        )
    names = {t.name for t in reader.tensors}
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in names:
        what = "rope_freqs factors" if scaling in ("none", "linear") else f"{scaling!r} RoPE"
        raise ModelLoadError(f"--quantization gguf: {path} uses {what}; use --quantization none")
    hidden, heads = (
        field(reader, f"{arch}.embedding_length"),
        field(reader, f"{arch}.attention.head_count"),
    )
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(embed.shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    cfg |= moe_hf_fields(reader, arch, names, cfg["num_hidden_layers"])
    if scaling == "linear":
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": field(reader, f"{arch}.rope.scaling.factor"),
        }
    return cfg
