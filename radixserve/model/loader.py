"""Loads a model: HF folder (config.json + safetensors shards), GGUF file, or dummy weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from radixserve.config import LoadConfig, ModelConfig
from radixserve.config.model import UnsupportedModelError
from radixserve.distributed.group import TPGroup
from radixserve.model.gemma3 import Gemma3ForCausalLM
from radixserve.model.gguf_convert import converted_folder, tokenizer_folder
from radixserve.model.llama import LlamaForCausalLM, hf_weight_shapes
from radixserve.model.pooling import check_last_token_pooling
from radixserve.model.quant.block_matmul import resolve_cpu_quant_kernel
from radixserve.model.quant.gguf_moe import is_moe_gguf
from radixserve.model.quant.gguf_weights import (
    field,
    gguf_hf_config,
    load_gguf_weights,
    loads_as_is,
    read_gguf,
    why_not_as_is,
)
from radixserve.model.quant.gptq_awq import (
    PACKED_METHODS,
    PackedFormat,
    check_packed_shards,
    load_packed_weights,
)
from radixserve.model.quant.quantize import (
    QuantizationError,
    check_quantization,
    configure_int_layers,
    quantize_model,
    resolve_quantization,
)
from radixserve.model.source import ModelLoadError, ModelSource, builtin_config, resolve_model
from radixserve.model.tp_shard import ShardLayout

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer_path: Path | None  # folder with tokenizer files; None for built-in configs
    name: str
    quantization: str  # as resolved: `auto` became the checkpoint's method or none
    dtype: torch.dtype  # what the model computes in (--dtype auto resolved with it)


def load_model(load_config: LoadConfig, tp: TPGroup | None = None) -> LoadedModel:
    """Resolves `load_config.model`, reads its config, builds the model and fills its weights.
    With a tensor-parallel group, builds this rank's shard and reads only its part of each
    checkpoint tensor (never the full model)."""
    tp = tp or TPGroup.single()
    check_load_format(load_config)
    source = resolve_model(load_config.model)
    reader = _gguf_reader(source, load_config)
    if reader is not None and is_moe_gguf(reader):
        return _load_moe_gguf(source, load_config, reader, tp)
    if load_config.quantization == "gguf":
        return _load_gguf_as_is(source, load_config, reader, tp)
    if _may_load_gguf_as_is(source, load_config):
        kquants = resolve_cpu_quant_kernel(load_config.cpu_quant_kernel) == "blocks"
        if loads_as_is(reader, kquants):
            as_is = replace(load_config, quantization="gguf")
            return _load_gguf_as_is(source, as_is, reader, tp)
        log_dequantized_fallback(source, reader, kquants)
    folder = _hf_folder(source, load_config.load_format)
    hf_config = builtin_config(source.name) if folder is None else read_hf_config(folder)
    load_config = resolve_quantization(load_config, hf_config)
    config = ModelConfig.from_hf_dict(hf_config)
    refuse_moe_options(load_config, config)
    check_embedding_model(load_config, config, folder, tp.size)
    check_rank_quantization(load_config, ShardLayout(config, tp.rank, tp.size))
    device, dtype = load_config.torch_device(), load_config.torch_dtype()
    model = _empty_model(config, device, dtype, tp)
    if load_config.load_format == "dummy":
        model.load_weights(_dummy_weights(model.layout, load_config.seed, device, dtype))
    elif load_config.quantization in PACKED_METHODS:
        fmt = PackedFormat.from_hf_config(hf_config)
        load_packed_weights(model, _iter_safetensors(folder), fmt)
    else:
        model.load_weights(_iter_safetensors(folder, model.layout))
    quantize_model(model, load_config)
    configure_int_layers(model, load_config)
    model.eval()
    tokenizer_path = folder if folder is not None and has_tokenizer(folder) else None
    return _loaded(model, config, tokenizer_path, source.name, load_config)


def peek_model_config(load_config: LoadConfig) -> ModelConfig:
    """The model's config without its weights (a GGUF file is converted, once, here)."""
    source = resolve_model(load_config.model)
    reader = _gguf_reader(source, load_config)
    if reader is not None and (load_config.quantization == "gguf" or is_moe_gguf(reader)):
        return ModelConfig.from_hf_dict(gguf_hf_config(reader, source.path))
    folder = _hf_folder(source, load_config.load_format)
    hf_config = builtin_config(source.name) if folder is None else read_hf_config(folder)
    return ModelConfig.from_hf_dict(hf_config)


def _gguf_reader(source: ModelSource, load_config: LoadConfig):
    """The GGUF file's reader, if the model is one read as GGUF; else None. At a method that
    converts through transformers (none, int8, ...), a file our reader cannot parse (a
    big-endian one) is left to transformers' reader, as before MoE GGUFs were read here."""
    if source.kind != "gguf" or load_config.load_format not in ("auto", "gguf"):
        return None
    try:
        return read_gguf(source.path)
    except ModelLoadError:
        if load_config.quantization in ("auto", "gguf"):
            raise
        return None


def _load_moe_gguf(
    source: ModelSource, load_config: LoadConfig, reader, tp: TPGroup
) -> LoadedModel:
    """An MoE GGUF (qwen3moe, qwen2moe, Mixtral's llama with experts) is read by our GGUF
    reader at every --quantization (transformers' GGUF conversion has no Mixtral and drops
    Qwen2-MoE's expert width). gguf (and `auto` where `loads_as_is`, on CPU): experts and
    projections kept as their blocks; none / int8 / int4: every tensor dequantized to fp32,
    then quantized on load."""
    method = load_config.quantization
    if method == "auto":
        on_cpu = load_config.torch_device().type == "cpu"
        kquants = resolve_cpu_quant_kernel(load_config.cpu_quant_kernel) == "blocks"
        method = "gguf" if on_cpu and loads_as_is(reader, kquants) else "none"
        if method == "none":
            log_dequantized_fallback(source, reader, kquants)
    load_config = replace(load_config, quantization=method)
    if method == "gguf":
        return _load_gguf_as_is(source, load_config, reader, tp)
    return _load_gguf_as_is(source, load_config, reader, tp, dequantize=True)


def _may_load_gguf_as_is(source: ModelSource, load_config: LoadConfig) -> bool:
    """`auto` on a .gguf file on CPU: gguf if its blocks load as they are (`loads_as_is`);
    tensor-parallel ranks each cut their part from the blocks."""
    return (
        load_config.quantization == "auto"
        and source.kind == "gguf"
        and load_config.load_format in ("auto", "gguf")
        and load_config.torch_device().type == "cpu"
    )


def log_dequantized_fallback(source: ModelSource, reader, kquants: bool) -> None:
    """Says why `auto` dequantizes this GGUF to fp32 instead of keeping its blocks."""
    reason = why_not_as_is(reader, kquants)
    logger.info("%s: loading the GGUF dequantized to fp32: %s", source.name, reason)


def _load_gguf_as_is(
    source: ModelSource,
    load_config: LoadConfig,
    reader=None,
    tp: TPGroup | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """`--quantization gguf`: config from the file's metadata, projections kept packed (a
    tensor-parallel rank: its part of each, cut along whole blocks); `dequantize` (an MoE
    GGUF at none / int8 / int4): every tensor fp32, then quantized on load as asked."""
    tp = tp or TPGroup.single()
    if source.kind != "gguf" or load_config.load_format not in ("auto", "gguf"):
        raise QuantizationError(
            f"--quantization gguf needs a .gguf model and load_format auto or gguf; "
            f"got {source.name!r} ({source.kind}) with load_format={load_config.load_format!r}"
        )
    reader = read_gguf(source.path) if reader is None else reader
    config = ModelConfig.from_hf_dict(gguf_hf_config(reader, source.path))
    refuse_moe_options(load_config, config)
    check_quantization(load_config, ShardLayout(config, tp.rank, tp.size).local_config())
    model = _empty_model(config, load_config.torch_device(), load_config.torch_dtype(), tp)
    on_cpu = load_config.torch_device().type == "cpu"
    blocks = on_cpu and resolve_cpu_quant_kernel(load_config.cpu_quant_kernel) == "blocks"
    load_gguf_weights(model, reader, config, blocks and not dequantize, dequantize)
    quantize_model(model, load_config)
    configure_int_layers(model, load_config)
    model.eval()
    has_vocab = field(reader, "tokenizer.ggml.model") is not None
    tokenizer_path = tokenizer_folder(source.path) if has_vocab else None
    return _loaded(model, config, tokenizer_path, source.name, load_config)


def check_load_format(load_config: LoadConfig) -> None:
    if load_config.load_format not in LOAD_FORMATS:
        allowed = ", ".join(LOAD_FORMATS)
        raise ValueError(f"load_format must be one of {allowed}; got {load_config.load_format!r}")


def check_embedding_model(
    load_config: LoadConfig, config: ModelConfig, folder: Path | None, tp_size: int = 1
) -> None:
    """A checkpoint without an LM head serves embeddings (or a classifier's scores) only, a
    classifier's head on one rank; an embedding model's own pooling config must be
    last-token pooling (model/pooling.py)."""
    if config.num_labels is not None and tp_size > 1:
        raise UnsupportedModelError(
            f"{config.hf_config['architectures'][0]}'s score head is not sharded: --tp-size 1"
        )
    if config.headless and not load_config.is_embedding:
        raise UnsupportedModelError(
            f"{config.hf_config['architectures'][0]} has no LM head: it cannot generate; "
            "serve it with --is-embedding"
        )
    if load_config.is_embedding and folder is not None:
        check_last_token_pooling(folder)


def check_rank_quantization(load_config: LoadConfig, layout: ShardLayout) -> None:
    """Every start-up check of --quantization (resolved, not `auto`) for one rank's shard: a
    GPTQ / AWQ checkpoint's groups whole on each rank (naming --tp-size), then the method's
    own checks on the shard's shapes."""
    if load_config.quantization in PACKED_METHODS:
        check_packed_shards(PackedFormat.from_hf_config(layout.config.hf_config), layout)
    check_quantization(load_config, layout.local_config())


MOE_METHODS = ("none", "auto", "int8", "int4", "gguf")
"""What MoE experts run as: fp, int8 / int4 quantized on load, a GGUF's blocks (per expert,
model/moe.py `use_expert_layers`)."""


def refuse_moe_options(load_config: LoadConfig, config: ModelConfig) -> None:
    """fp8 and the GPTQ / AWQ layouts hold no experts yet; an expert's rounding may depend on
    how many rows it gets (not batch-invariant)."""
    if config.moe is None:
        return
    method = load_config.quantization
    if method not in MOE_METHODS:
        raise QuantizationError(
            f"--quantization {method} is not supported for the mixture-of-experts "
            f"{config.architecture} yet; use --quantization none, int8, int4 or gguf"
        )
    if load_config.enable_deterministic_inference:
        raise ValueError(
            f"--enable-deterministic-inference is not supported for the mixture-of-experts "
            f"{config.architecture} yet (its experts' matmuls are not batch-invariant)"
        )


def _loaded(model, config, tokenizer_path, name, load_config: LoadConfig) -> LoadedModel:
    return LoadedModel(
        model=model,
        config=config,
        tokenizer_path=tokenizer_path,
        name=name,
        quantization=load_config.quantization,
        dtype=load_config.torch_dtype(),
    )


def weights_folder(model: str | None) -> Path:
    """The HF folder that holds `model`'s weights (a GGUF's converted, cached folder)."""
    return _hf_folder(resolve_model(model), "auto")


def _hf_folder(source: ModelSource, load_format: str) -> Path | None:
    if source.kind == "builtin":
        if load_format != "dummy":
            raise ModelLoadError(
                f"{source.name!r} is a built-in config without weights; use load_format='dummy'"
            )
        return None
    if load_format == "gguf" and source.kind != "gguf":
        raise ModelLoadError(f"load_format='gguf' but {source.path} is not a .gguf file")
    if load_format == "safetensors" and source.kind != "hf":
        raise ModelLoadError(f"load_format='safetensors' but {source.path} is not an HF folder")
    return converted_folder(source.path) if source.kind == "gguf" else source.path


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"config.json not found in {folder}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def has_tokenizer(folder: Path) -> bool:
    """True if `folder` ships its own tokenizer files."""
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _empty_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None
) -> LlamaForCausalLM:
    """Builds the model on the meta device (no init cost), then allocates it uninitialized."""
    with _default_dtype(dtype), torch.device("meta"):
        model = (Gemma3ForCausalLM if config.gemma else LlamaForCausalLM)(config, tp)
    return model.to_empty(device=device)


def _dummy_weights(
    layout: ShardLayout, seed: int, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random HF-named weights, seeded: small normal matrices, unit norms, zero biases. Each
    full tensor is drawn in turn and this rank keeps its part, so every tp size gets the same
    model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in hf_weight_shapes(layout.config).items():
        if name.endswith("norm.weight"):
            full = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            full = torch.zeros(shape, dtype=dtype, device=device)
        else:
            full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        yield name, layout.select(name, full)


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of an HF folder (via model.safetensors.index.json when present)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"safetensors shard not found: {f}")
    return files


def _iter_safetensors(
    folder: Path, layout: ShardLayout | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor; with a layout, only this rank's part of each
    is read from the file."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if layout is None or layout.size == 1:
                        yield name, f.get_tensor(name)
                    else:
                        yield name, layout.select(name, f.get_slice(name))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc
