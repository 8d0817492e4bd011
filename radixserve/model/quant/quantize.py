"""Quantize-on-load: the checks made before any weight is read, then the swap of layers.

Quantized: every decoder layer's four projections (~all of the matmul work but the LM head).
Kept in the model dtype: the token embedding, the RMSNorms, and the LM head unless
`quantize_lm_head` (int8 / int4; a tied head gets its own quantized copy).

    method  device     layer                   weights stored as
    none    any        UnquantizedLinear       the model dtype
    int8    any        Int8WeightOnlyLinear    int8, one scale per output channel
    int4    CPU, CUDA  Int4WeightOnlyLinear    4 bits, scale + zero per group of 32 inputs
                                               (or 64 / 128: --quantization-group-size)
    fp8     CUDA       Fp8Linear               float8_e4m3fn, one scale per output channel
    gguf    CPU, CUDA  int4 / int8 / fp        a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks, as
                                               they are (gguf_weights.py); no quantize-on-load
    gptq    CPU        Int4WeightOnlyLinear    a GPTQ checkpoint's 4-bit qweight / qzeros /
                                               scales as they are (gptq_awq.py); desc_act false
    awq     CPU        Int4WeightOnlyLinear    an AWQ (gemm) checkpoint's, likewise

`auto` (the default) is the checkpoint's own method when its config.json has a
`quantization_config` (gptq / awq), else none; an explicit method must agree with the
checkpoint (int8 on a GPTQ folder, gptq on a plain one: an error at start).

Kernels (linear.py): on CPU int4 groups of 32 run our C++ block kernels as a GGUF file's Q4_1
blocks do (--cpu-quant-kernel, fp32 or int8 activations, the decode stack), other sizes
torch's (out_features divisible by 16); on CUDA our Triton kernels. A layer the group size
cannot fit is an error at start, not a silent fp fallback. Why 32 by default (quant_quality.py,
docs/performance.md "Quality of the defaults"): the default model is a Q4_1 GGUF, and groups
of 32 rebuild its blocks of 32 exactly (+0.00% perplexity); 64 / 128 put two or four blocks
on one grid (+25% at 64).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from radixserve.config import LoadConfig, ModelConfig
from radixserve.model.quant import QuantizationError
from radixserve.model.quant import linear as quant_linear
from radixserve.model.quant.activation_choice import (
    configure_block_activations,
    configure_dense_dtype,
)
from radixserve.model.quant.batch_invariant import make_fp_layers_batch_invariant
from radixserve.model.quant.block_matmul import block_kernels, quantized_int4_backend
from radixserve.model.quant.dense_choice import use_packed_dense
from radixserve.model.quant.flag_checks import AUTO, check_quantization_flags
from radixserve.model.quant.gptq_awq import PACKED_METHODS, PackedFormat, checkpoint_quant_method
from radixserve.model.quant.kquant import KQuantLinear
from radixserve.model.quant.linear import (
    INT4_GROUP_SIZES,
    INT4_OUT_MULTIPLE,
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    dense_linear,
)

logger = logging.getLogger(__name__)

INT_KERNEL_METHODS = ("int8", "int4", "gguf", *PACKED_METHODS)  # int8 / int4 layers
NOT_REQUANTIZED = ("none", "gguf", *PACKED_METHODS)  # no quantize-on-load for these
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # input columns split under TP
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both matrix dims divisible by 16
INT4_DEFAULT_GROUP_SIZE = 32  # chosen by benchmarks/quant_quality.py (module docstring)


def projection_shapes(config: ModelConfig, lm_head: bool = False) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each quantized projection of one layer (+ the LM head)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes = {
        "self_attn.qkv_proj": (q_size + 2 * kv_size, config.hidden_size),
        "self_attn.o_proj": (config.hidden_size, q_size),
        "mlp.gate_up_proj": (2 * config.intermediate_size, config.hidden_size),
        "mlp.down_proj": (config.hidden_size, config.intermediate_size),
    }
    if config.moe is not None:  # each expert's layers (and Qwen2-MoE's shared expert)
        moe = config.moe
        for name, inter in (
            ("experts", moe.intermediate_size),
            ("shared_expert", moe.shared_expert_intermediate_size),
        ):
            if inter:
                shapes[f"mlp.{name}.gate_up_proj"] = (2 * inter, config.hidden_size)
                shapes[f"mlp.{name}.down_proj"] = (config.hidden_size, inter)
    if lm_head:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    return shapes


def resolve_quantization(load_config: LoadConfig, hf_config: dict[str, Any]) -> LoadConfig:
    """`load_config` with `auto` replaced by the checkpoint's method (gptq / awq) or none;
    an explicit method that disagrees with the checkpoint is an error."""
    found = checkpoint_quant_method(hf_config)
    requested = load_config.quantization
    _check_agrees_with_checkpoint(requested, found)
    method = (found or "none") if requested == AUTO else requested
    if method in PACKED_METHODS and load_config.load_format == "dummy":
        raise QuantizationError(
            f"--load-format dummy cannot fill the packed projections of a {method} checkpoint"
        )
    return replace(load_config, quantization=method)


def _check_agrees_with_checkpoint(requested: str, found: str | None) -> None:
    if found is not None and found not in PACKED_METHODS:
        raise QuantizationError(
            f"the checkpoint's quantization_config.quant_method is {found!r}; "
            f"--quantization reads {' and '.join(PACKED_METHODS)} checkpoints only"
        )
    if requested in PACKED_METHODS and found != requested:
        raise QuantizationError(
            f"--quantization {requested} needs a checkpoint whose config.json has "
            f"quantization_config.quant_method {requested!r}; this one has {found!r}"
        )
    if found is not None and requested not in (AUTO, found):
        raise QuantizationError(
            f"--quantization {requested} cannot apply to this {found} checkpoint (its projections "
            f"are packed 4-bit already); leave --quantization at auto or pass {found}"
        )


def check_quantization(load_config: LoadConfig, config: ModelConfig) -> None:
    """Rejects, before loading weights, every option this model and device cannot run."""
    check_quantization_flags(load_config)
    method = load_config.quantization
    device = load_config.torch_device()
    if device.type == "cpu" and method in INT_KERNEL_METHODS and not _on_block_kernels(load_config):
        _warn_if_slow_dtype(method, load_config.quant_compute_dtype())
    shapes = projection_shapes(config, load_config.quantize_lm_head)
    if method == "fp8":
        _check_fp8(device, load_config.torch_dtype(), shapes)
    elif method == "int4":
        blocks = device.type == "cpu" and _on_block_kernels(load_config)
        _check_int4(device, shapes, load_config.quantization_group_size, blocks)
    elif method == "gguf":
        _check_gguf(device, shapes)
    elif method in PACKED_METHODS:
        _check_packed(method, device, shapes, PackedFormat.from_hf_config(config.hf_config))


def _on_block_kernels(load_config: LoadConfig) -> bool:
    """gguf layers, and int4 ones in groups of 32, on the C++ block kernels compute in fp32
    at full speed."""
    method, group_size = load_config.quantization, load_config.quantization_group_size
    if method not in ("gguf", "int4") or load_config.cpu_quant_kernel == "torch":
        return False
    if method == "int4" and group_size not in (None, INT4_DEFAULT_GROUP_SIZE):
        return False
    return block_kernels() is not None


def _warn_if_slow_dtype(method: str, dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16:
        logger.warning(
            "--quantization %s with %s activations runs torch's slow CPU path (~10x slower "
            "decode, ~50x slower prefill than bfloat16); --dtype auto runs them in bfloat16",
            method,
            str(dtype).removeprefix("torch."),
        )


def _check_fp8(device: torch.device, dtype: torch.dtype, shapes: dict) -> None:
    if device.type != "cuda":
        raise QuantizationError(
            f"--quantization fp8 needs a CUDA GPU (device is {device.type}); "
            "on CPU use --quantization int8 or int4"
        )
    if dtype != torch.bfloat16:
        raise QuantizationError("--quantization fp8 needs --dtype bfloat16 (or auto)")
    for name, dims in shapes.items():
        if any(d % FP8_DIM_MULTIPLE for d in dims):
            raise QuantizationError(
                f"--quantization fp8: {name} is {dims[0]}x{dims[1]}; "
                f"both dims must be multiples of {FP8_DIM_MULTIPLE}"
            )


def _check_int4(device: torch.device, shapes: dict, group_size: int | None, blocks: bool) -> None:
    _check_int4_device("int4", device, shapes, blocks)  # the size is one of INT4_GROUP_SIZES
    for name, (_, in_features) in shapes.items():
        if int4_group_size(in_features, group_size) is None:
            raise QuantizationError(_group_size_message(name, in_features, group_size, shapes))


def _check_gguf(device: torch.device, shapes: dict) -> None:
    """Q4 blocks become int4 layers, Q8_0 blocks group-wise int8 layers."""
    _check_int4_device("gguf", device, shapes, blocks=False)


def _check_int4_device(method: str, device: torch.device, shapes: dict, blocks: bool) -> None:
    """int4 layers run torch's CPU kernel (out_features divisible by 16), our block kernels
    (`blocks`: any out_features) or, on CUDA, the Triton kernel (triton installed)."""
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(
            f"--quantization {method} runs on CPU or CUDA; device is {device.type}"
        )
    backend = quant_linear.matmul_backend(device)
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise QuantizationError(
            f"--quantization {method} on {device.type} needs triton for its int4/int8 "
            "kernels (pip install triton)"
        )
    for name, (out_features, _) in shapes.items():
        if backend == "torch" and not blocks and out_features % INT4_OUT_MULTIPLE:
            raise QuantizationError(
                f"--quantization {method}: {name} has out_features={out_features}, which "
                f"torch's CPU int4 kernel needs divisible by {INT4_OUT_MULTIPLE}"
            )


def _check_packed(method: str, device: torch.device, shapes: dict, fmt: PackedFormat) -> None:
    """GPTQ / AWQ projections become int4 layers: CPU, out_features % 16, whole groups."""
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization {method} runs on CPU only (torch's CPU int4 kernel)"
        )
    for name, (out_features, in_features) in shapes.items():
        if out_features % INT4_OUT_MULTIPLE:
            raise QuantizationError(
                f"--quantization {method}: {name} has out_features={out_features}, which "
                f"torch's int4 kernel needs divisible by {INT4_OUT_MULTIPLE}"
            )
        if in_features % fmt.group_size:
            raise QuantizationError(
                f"--quantization {method}: the checkpoint's quantization_config.group_size="
                f"{fmt.group_size} does not divide in_features={in_features} of {name}"
            )


def _group_size_message(name: str, in_features: int, group_size: int | None, shapes) -> str:
    fitting = [g for g in INT4_GROUP_SIZES if all(i % g == 0 for _, i in shapes.values())]
    hint = (
        f"sizes that fit every layer: {', '.join(map(str, fitting))}"
        if fitting
        else ("no group size fits every layer; use --quantization int8")
    )
    if group_size is None:
        return f"--quantization int4: in_features={in_features} of {name} is no multiple of 32"
    return (
        f"--quantization-group-size {group_size} does not divide in_features={in_features} "
        f"of {name}; {hint}"
    )


def int4_group_size(in_features: int, requested: int | None) -> int | None:
    """The group size one layer uses: `requested` if it divides in_features, else None;
    by default INT4_DEFAULT_GROUP_SIZE (32, a GGUF block: see the module docstring)."""
    size = INT4_DEFAULT_GROUP_SIZE if requested is None else requested
    return size if in_features % size == 0 else None


def quantize_model(model: nn.Module, load_config: LoadConfig) -> None:
    """Replaces the fp projections (and the LM head if asked) by their quantized form."""
    method = load_config.quantization
    if method in NOT_REQUANTIZED:
        return
    make = _quantizer(method, load_config)
    tp = getattr(model, "tp", None)
    before = weight_bytes(model)
    for layer in model.layers:
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            if hasattr(owner, "quantize_experts"):  # a routed MLP (model/moe.py): at once
                if attr == "gate_up_proj":
                    owner.quantize_experts(make)
                continue
            linear = getattr(owner, attr)
            if tp is not None and tp.size > 1 and path in ROW_PARALLEL:
                quantized = _quantize_row_shard(linear, method, load_config, tp)
            else:
                quantized = make(linear)
            setattr(owner, attr, quantized)
    if load_config.quantize_lm_head:
        model.lm_head = make(lm_head_linear(model))
    logger.info(
        "quantized %d projections to %s: weights %.1f MiB -> %.1f MiB",
        len(model.layers) * len(PROJECTIONS),
        method,
        before / 2**20,
        weight_bytes(model) / 2**20,
    )


def configure_int_layers(model: nn.Module, load_config: LoadConfig) -> None:
    """Every int8 / int4 layer, however it was built: its kernel runs in
    LoadConfig.quant_compute_dtype (the "blocks" kernels, compute_dtype None, compute in fp32
    on any input: only their prefill matmul runs in it), and with
    --enable-deterministic-inference it stays on its row-wise kernel for every batch; on CPU
    the fp layers left (the LM head, unquantized projections) then become
    BatchInvariantLinear, as they do without it where `--cpu-dense-kernel` picks our kernel
    (dense_choice.py)."""
    dtype = load_config.quant_compute_dtype()
    deterministic = load_config.enable_deterministic_inference
    for module in model.modules():
        if isinstance(module, (Int8WeightOnlyLinear, Int4WeightOnlyLinear, KQuantLinear)):
            if module.compute_dtype is None:  # block kernels: fp32; prefill's matmul in dtype
                module.dense_dtype = dtype
            elif module.compute_dtype != dtype:
                module.set_compute_dtype(dtype)
            if deterministic:
                module.dequant_min_rows = None
    if load_config.torch_device().type != "cpu":
        return
    if not deterministic:  # there every row count stays on the kernels: no dense matmul
        configure_dense_dtype(model, dtype)
    configure_block_activations(model, load_config.cpu_quant_activation, deterministic)
    kernel = load_config.cpu_dense_kernel
    if deterministic or use_packed_dense(model, kernel, load_config.torch_dtype()):
        swapped = make_fp_layers_batch_invariant(model)
        if not deterministic:
            logger.info("--cpu-dense-kernel %s: %d fp layers on the packed kernel", kernel, swapped)


def _quantize_row_shard(linear: nn.Linear, method: str, load_config: LoadConfig, tp) -> nn.Module:
    """A row-parallel shard (a slice of the input columns), quantized as its slice of the
    whole layer would be at tp 1: int8 and fp8 with each row's scale over every rank's
    columns (max of the ranks' max), int4 with the group size of the whole input, whose
    groups then fall whole inside each rank's slice."""
    if method in ("int8", "fp8"):
        absmax = tp.all_reduce_max(linear.weight.detach().abs().amax(dim=1).float())
        layer = Int8WeightOnlyLinear if method == "int8" else Fp8Linear
        return layer.from_float(linear, absmax)
    if method != "int4":
        raise QuantizationError(f"--quantization {method} is not sharded over --tp-size")
    requested = load_config.quantization_group_size
    group_size = int4_group_size(linear.in_features * tp.size, requested)
    if group_size is None or linear.in_features % group_size:
        raise QuantizationError(
            f"--tp-size {tp.size}: a row-parallel layer's {linear.in_features} input columns "
            f"per rank hold no whole int4 group of {group_size or requested}; pass a smaller "
            f"--quantization-group-size (one of {', '.join(map(str, INT4_GROUP_SIZES))})"
        )
    return _int4_layer(linear, group_size, load_config)


def _int4_layer(linear: nn.Linear, group_size: int, load_config: LoadConfig) -> nn.Module:
    backend = None  # the device's kernel; on CPU groups of 32 may take the block kernels
    if quant_linear.matmul_backend(linear.weight.device) == "torch":
        backend = quantized_int4_backend(load_config.cpu_quant_kernel, group_size)
    return Int4WeightOnlyLinear.from_float(linear, group_size, backend=backend)


def _quantizer(method: str, load_config: LoadConfig) -> Callable[[nn.Linear], nn.Module]:
    if method == "int8":
        return Int8WeightOnlyLinear.from_float
    if method == "fp8":
        return Fp8Linear.from_float
    group_size = load_config.quantization_group_size
    return lambda linear: _int4_layer(
        linear, int4_group_size(linear.in_features, group_size), load_config
    )


def lm_head_linear(model: nn.Module) -> nn.Linear:
    """The LM head as a linear layer; a tied head shares the embedding's weight."""
    if model.lm_head is not None:
        return model.lm_head
    return dense_linear(model.head_weight())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (what the weights occupy in memory)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
