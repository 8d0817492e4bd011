"""A Q4_K_M-typed GGUF of a realistic Llama shape whose blocks are random bytes, written
without llama-quantize (for load-time and memory measurements, where values do not matter).

Types follow llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for attn_v and ffn_down in the layers its
`use_more_bits` picks (the first and last eighth, every third between) and for the head
(output.weight, or token_embd when tied). Each block's scale fields are set small (so the
weights stay under ~0.1 and a decode's logits stay finite); the rest of its bytes are random.
The tokenizer keys are the default model's (radixserve_bench.realistic_gguf, as its files).

Run:  python benchmarks/random_kquant_gguf.py --shape llama-3.1-8b   (prints the path)
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np

from radixserve.disk_cache import cache_root
from radixserve_bench.realistic_gguf import (
    SHAPES,
    LlamaShape,
    _add_llama_keys,
    default_tokenizer_fields,
    tensor_specs,
)

LLAMA_FTYPE_Q4_K_M = 15
# type -> (bytes per 256 weights, [(byte offset, fp16 value)] of its scale fields, int8 scale
# bytes set to 1)
BLOCKS = {
    "Q4_K": (144, [(0, 1e-4), (2, 1e-4)], None),
    "Q6_K": (210, [(208, 1e-3)], slice(192, 208)),
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers that keep attn_v / ffn_down in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, shape: LlamaShape) -> str | None:
    """Q4_K / Q6_K for a matrix, None for a norm (kept F32)."""
    if name.endswith("_norm.weight"):
        return None
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(layer, shape.layers) else "Q4_K"
    return "Q4_K"


def random_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * bytes] uint8 blocks with small scale fields."""
    block_bytes, halfs, int8_scales = BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset, value in halfs:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    if int8_scales is not None:
        blocks[..., int8_scales] = 1
    return blocks.reshape(rows, -1)


def write_random_kquant_gguf(shape_name: str, path: Path, seed: int = 0) -> Path:
    """Writes the file (through a `.partial` renamed into place); returns its path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    tokenizer = default_tokenizer_fields()
    shape = replace(SHAPES[shape_name], vocab=len(tokenizer["tokenizer.ggml.tokens"][0]))
    specs = tensor_specs(shape)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), "llama")
    _add_llama_keys(writer, shape, LLAMA_FTYPE_Q4_K_M)
    for key, (value, vtype, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type)
    types = [tensor_type(spec.name, shape) for spec in specs]
    for spec, kind in zip(specs, types):
        if kind is None:
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes)
            continue
        rows, cols = spec.shape
        nbytes = rows * cols // 256 * BLOCKS[kind][0]
        byte_shape = (rows, nbytes // rows)
        raw = GGMLQuantizationType[kind]
        writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec, kind in zip(specs, types):
        if kind is None:
            writer.write_tensor_data(np.ones(spec.shape, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(*spec.shape, kind, rng))
    writer.close()
    partial.rename(path)
    return path


def random_kquant_gguf(shape_name: str, out_dir: Path | None = None) -> Path:
    """The file for `shape_name`, written on first use."""
    out_dir = out_dir or cache_root() / "realistic-gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{shape_name}-random-Q4_K_M.gguf"
    return path if path.exists() else write_random_kquant_gguf(shape_name, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--out-dir", type=Path, default=None)
    print(random_kquant_gguf(p.parse_args().shape, p.parse_args().out_dir))


if __name__ == "__main__":
    main()
