"""Random-weight GGUFs at the sizes users run, so that radixserve and llama-server serve
exactly the same file offline (nothing downloaded, nothing written into the repository).

    shape (Llama-3.2-1B / Llama-3.1-8B: hidden, layers, heads, MLP; vocab and tokenizer
           metadata copied from the default model's GGUF, SmolLM2's 49,152 tokens)
      -> <cache>/realistic-gguf/<shape>-F16.gguf   written one tensor at a time (an 8B F16
         is 15 GB: never held in memory), weights ~ N(0, std), norm weights 1, seeded per
         tensor; F32 on request
      -> llama-quantize <F16> <shape>-<type>.gguf <type>   llama.cpp's own quantizer and mixes
         (Q4_K_M: Q4_K with Q6_K attn_v / ffn_down in some layers and a Q6_K head), built
         beside llama-server on first use (radixserve_bench.llama_build)

No RoPE scaling (Llama 3's rope_freqs are left out: random weights have no long context to
keep), context 8192, rope base 500000 as Llama 3 has it. Both systems produce finite logits;
the text is noise, so benchmarks ignore EOS.

Run:  python -m radixserve_bench.realistic_gguf --shape llama-3.2-1b --types Q4_K_M,Q4_0
      (prints one path per type; files already there are kept)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.disk_cache import cache_root

QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL")
"""llama-quantize's type names this script writes (its ftype argument)."""
SOURCE_TYPES = {"F16": (np.float16, 1), "F32": (np.float32, 0)}
"""Unquantized file type -> (matrix dtype, general.file_type)."""
DEFAULT_STD = 0.02  # transformers' LlamaConfig.initializer_range


@dataclass(frozen=True)
class LlamaShape:
    """A llama-architecture model's sizes (what a GGUF's llama.* keys say)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    """True: no output.weight, the head is token_embd (Llama-3.2-1B)."""
    vocab: int | None = None
    """None: the tokenizer's token count."""
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    s.name: s
    for s in (
        LlamaShape("llama-3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192,
                   tied=True),
        LlamaShape("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336,
                   tied=False),
    )
}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name, numpy-order shape and element dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # np.float16 | np.float32

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def tensor_specs(shape: LlamaShape, dtype: Any = np.float16) -> list[TensorSpec]:
    """Every tensor of a llama GGUF of `shape`: matrices in `dtype`, norms in F32 (as
    llama.cpp's converter and quantizer keep them)."""
    if shape.vocab is None:
        raise ValueError(f"{shape.name}: vocab must be set (from the tokenizer) first")
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("token_embd.weight", (shape.vocab, h), dtype)]
    for i in range(shape.layers):
        parts = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h),
                 "attn_output": (h, q), "ffn_norm": (h,), "ffn_gate": (shape.mlp, h),
                 "ffn_up": (shape.mlp, h), "ffn_down": (h, shape.mlp)}  # fmt: skip
        for part, dims in parts.items():
            specs.append(TensorSpec(f"blk.{i}.{part}.weight", dims, _dtype_of(dims, dtype)))
    specs.append(TensorSpec("output_norm.weight", (h,), np.float32))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (shape.vocab, h), dtype))
    return specs


def _dtype_of(dims: tuple[int, ...], dtype: Any) -> Any:
    return np.float32 if len(dims) == 1 else dtype


def random_tensor(spec: TensorSpec, index: int, seed: int, std: float) -> np.ndarray:
    """Norms: ones; matrices: N(0, std) from a generator seeded by (seed, tensor index),
    drawn in row chunks so that only the output array is large."""
    if len(spec.shape) == 1:
        return np.ones(spec.shape, dtype=spec.dtype)
    rng = np.random.default_rng([seed, index])
    out = np.empty(spec.shape, dtype=spec.dtype)
    rows_per_chunk = max(1, (1 << 24) // spec.shape[1])
    for start in range(0, spec.shape[0], rows_per_chunk):
        chunk = rng.standard_normal((min(rows_per_chunk, spec.shape[0] - start), spec.shape[1]),
                                    dtype=np.float32)  # fmt: skip
        chunk *= std
        out[start : start + len(chunk)] = chunk
    return out


def tokenizer_fields(gguf_path: Path) -> dict[str, tuple[Any, Any, Any]]:
    """The `tokenizer.*` keys of a GGUF as (value, value type, array item type), exactly as
    stored, for a writer's add_key_value."""
    from gguf import GGUFReader, GGUFValueType

    fields = {}
    for key, f in GGUFReader(gguf_path).fields.items():
        if key.startswith("tokenizer."):
            sub_type = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            fields[key] = (f.contents(), f.types[0], sub_type)
    return fields


def default_tokenizer_fields() -> dict[str, tuple[Any, Any, Any]]:
    """The default model's tokenizer keys (its GGUF found by importlib, never imported)."""
    from radixserve.model.source import default_model_path

    return tokenizer_fields(default_model_path())


def write_gguf(
    path: Path, shape: LlamaShape, specs: list[TensorSpec],
    make: Callable[[int, TensorSpec], np.ndarray], tokenizer: dict | None, file_type: int,
) -> Path:  # fmt: skip
    """Writes a llama GGUF tensor by tensor (`make(index, spec)` is called once per tensor,
    in order), through a `.partial` file renamed into place."""
    from gguf import GGUFWriter

    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), "llama")
    _add_llama_keys(writer, shape, file_type)
    for key, (value, vtype, sub_type) in (tokenizer or {}).items():
        writer.add_key_value(key, value, vtype, sub_type)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(spec.dtype), spec.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, spec in enumerate(specs):
        tensor = make(index, spec)
        if tensor.shape != spec.shape or tensor.dtype != np.dtype(spec.dtype):
            raise ValueError(f"{spec.name}: made {tensor.shape} {tensor.dtype}, declared "
                             f"{spec.shape} {np.dtype(spec.dtype)}")  # fmt: skip
        writer.write_tensor_data(np.ascontiguousarray(tensor))
    writer.close()
    partial.rename(path)
    return path


def _add_llama_keys(writer, shape: LlamaShape, file_type: int) -> None:
    writer.add_name(f"random {shape.name}")
    writer.add_file_type(file_type)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.mlp)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)


def write_random_gguf(
    shape: LlamaShape, path: Path, source_type: str = "F16", tokenizer: dict | None = None,
    seed: int = 0, std: float = DEFAULT_STD,
) -> Path:  # fmt: skip
    """A random-weight GGUF of `shape` in F16 / F32; `tokenizer`: keys to copy (their token
    list sets the vocab when `shape.vocab` is None)."""
    if source_type not in SOURCE_TYPES:
        raise ValueError(f"source_type must be one of {', '.join(SOURCE_TYPES)}")
    if shape.vocab is None:
        if not tokenizer or "tokenizer.ggml.tokens" not in tokenizer:
            raise ValueError(f"{shape.name}: no vocab given and no tokenizer tokens to count")
        shape = replace(shape, vocab=len(tokenizer["tokenizer.ggml.tokens"][0]))
    dtype, file_type = SOURCE_TYPES[source_type]
    specs = tensor_specs(shape, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    make = lambda i, spec: random_tensor(spec, i, seed, std)  # noqa: E731
    return write_gguf(path, shape, specs, make, tokenizer, file_type)


def quantize_gguf(
    source: Path, out: Path, quant_type: str, threads: int, binary: Path | None = None, log=None
) -> Path:
    """`llama-quantize source out quant_type threads` (built on first use when `binary` is
    None), through a `.partial` file renamed into place."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(QUANT_TYPES)}; got {quant_type!r}")
    if binary is None:
        from radixserve_bench.llama_build import build_llama_quantize

        binary = build_llama_quantize()
    partial = out.with_name(out.name + ".partial")
    command = [str(binary), str(source), str(partial), quant_type, str(threads)]
    try:
        subprocess.run(command, check=True, stdout=log or subprocess.DEVNULL,
                       stderr=subprocess.STDOUT if log else subprocess.PIPE)  # fmt: skip
    except subprocess.CalledProcessError as exc:
        partial.unlink(missing_ok=True)
        tail = (exc.stderr or b"").decode(errors="replace")[-2000:]
        message = f"llama-quantize {quant_type} failed ({exc.returncode}): {tail}"
        raise RuntimeError(message) from exc
    partial.rename(out)
    return out


def realistic_ggufs(
    shape: LlamaShape, quant_types: Iterable[str], out_dir: Path, source_type: str = "F16",
    seed: int = 0, threads: int | None = None, delete_source: bool = False, log=sys.stderr,
) -> dict[str, Path]:  # fmt: skip
    """The source file and one file per quant type (kept where already written): type -> path."""
    source = out_dir / f"{shape.name}-{source_type}.gguf"
    paths = {t: out_dir / f"{shape.name}-{t}.gguf" for t in quant_types}
    if not source.exists() and not all(p.exists() for p in paths.values()):
        print(f"writing {source} ...", file=log, flush=True)
        write_random_gguf(shape, source, source_type, default_tokenizer_fields(), seed)
    for quant_type, path in paths.items():
        if not path.exists():
            print(f"llama-quantize -> {path} ...", file=log, flush=True)
            quantize_gguf(source, path, quant_type, threads or os.cpu_count() or 1)
    if delete_source and source.exists():
        source.unlink()
    return {**({source_type: source} if source.exists() else {}), **paths}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument(
        "--types",
        default="Q4_K_M,Q4_0",
        help=f"comma-separated, of {', '.join(QUANT_TYPES)}; empty: source only",
    )
    p.add_argument("--source-type", choices=sorted(SOURCE_TYPES), default="F16")
    p.add_argument("--out-dir", type=Path, default=cache_root() / "realistic-gguf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="llama-quantize's (default: cores)")
    p.add_argument(
        "--delete-source",
        action="store_true",
        help="remove the F16 / F32 file once quantized (an 8B F16 is 15 GB)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if bad := [t for t in types if t not in QUANT_TYPES]:
        raise SystemExit(f"--types: unknown {', '.join(bad)}; choose from {', '.join(QUANT_TYPES)}")
    paths = realistic_ggufs(SHAPES[args.shape], types, args.out_dir, args.source_type,
                            args.seed, args.threads, args.delete_source)  # fmt: skip
    for name, path in paths.items():
        print(f"{name}\t{path}")


if __name__ == "__main__":
    main()
