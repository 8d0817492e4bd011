"""The quantization flags' own checks, which need neither the model nor the device: names,
and which flags go together. `check_quantization` (quantize.py) runs them before its checks
of the model's shapes; the engine's preflight (engine/preflight.py) runs them before loading
anything."""

from __future__ import annotations

from radixserve.config import LoadConfig
from radixserve.model.quant import QuantizationError
from radixserve.model.quant.activation_choice import check_cpu_quant_activation
from radixserve.model.quant.block_matmul import CPU_QUANT_KERNELS
from radixserve.model.quant.dense_choice import check_cpu_dense_kernel
from radixserve.model.quant.gptq_awq import PACKED_METHODS
from radixserve.model.quant.linear import INT4_GROUP_SIZES

AUTO = "auto"
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8", "gguf", *PACKED_METHODS)


def check_quantization_flags(load_config: LoadConfig) -> None:
    """QuantizationError naming the first quantization flag out of its choices or given
    without the method it applies to."""
    method = load_config.quantization
    if method not in (AUTO, *QUANTIZATION_METHODS):
        allowed = ", ".join((AUTO, *QUANTIZATION_METHODS))
        raise QuantizationError(f"--quantization must be one of {allowed}; got {method!r}")
    group_size = load_config.quantization_group_size
    if group_size is not None and method != "int4":
        raise QuantizationError("--quantization-group-size applies to --quantization int4 only")
    if group_size is not None and group_size not in INT4_GROUP_SIZES:
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise QuantizationError(
            f"--quantization-group-size must be one of {sizes}; got {group_size}"
        )
    if load_config.quantize_lm_head and method not in ("int8", "int4"):
        raise QuantizationError(
            f"--quantize-lm-head needs --quantization int8 or int4; got {method!r}"
        )
    if load_config.cpu_quant_kernel not in CPU_QUANT_KERNELS:
        allowed = ", ".join(CPU_QUANT_KERNELS)
        raise QuantizationError(
            f"--cpu-quant-kernel must be one of {allowed}; got {load_config.cpu_quant_kernel!r}"
        )
    check_cpu_dense_kernel(load_config.cpu_dense_kernel)
    check_cpu_quant_activation(load_config.cpu_quant_activation)
