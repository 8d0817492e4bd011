"""LoadConfig: which model to run, on which device, in which dtype and quantization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the engine, not with the configs (radixserve/__init__.py)
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def dtype_named(name: str, flag: str) -> torch.dtype:
    """The torch dtype `name` (one of DTYPE_NAMES); a ValueError naming `flag` otherwise."""
    import torch

    if name not in DTYPE_NAMES:
        allowed = ", ".join(DTYPE_NAMES)
        raise ValueError(f"{flag} must be auto or one of {allowed}; got {name!r}")
    return getattr(torch, name)


@dataclass
class LoadConfig:
    """Which model to run and how to load it."""

    model: str | None = None
    """HF folder, .gguf file or built-in config name (llama-3-8b, ...); default: SmolLM2."""
    load_format: str = "auto"
    """auto | safetensors | gguf | dummy (random weights from the config, for benchmarking)."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16. On CPU the
    int8 / int4 / gguf / gptq / awq projections compute in bfloat16 whatever this is (torch's int
    kernels are fast in bfloat16 only; gguf on the C++ block kernels: fp32); the rest of the model
    (residual stream, norms, attention, KV pool, LM head) computes in this dtype."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda."""
    seed: int = 0
    """Seed for dummy weights."""
    quantization: str = "auto"
    """auto (the checkpoint's own: gptq | awq from its quantization_config; on CPU, gguf for
    a GGUF file whose projections are all Q4_0 / Q4_1 / Q8_0 / IQ4_NL (or fp), as the default
    model's Q4_1 are, or Q4_K / Q5_K / Q6_K where the C++ block kernels build; else none, for
    a GGUF file its dequantized fp copy) | none | int8 (weight-only, a scale per output
    channel) | int4 (weight-only, a scale and zero per group of input channels; CUDA: Triton
    kernel) | fp8 (CUDA, bf16) | gguf (a GGUF file's Q4_0 / Q4_1 / Q8_0 / IQ4_NL blocks and
    Q4_K / Q5_K / Q6_K super-blocks as they are, no fp32 detour; K-quants need the C++ block
    kernels, else they are dequantized to fp) | gptq | awq (CPU: a GPTQ / AWQ checkpoint's
    4-bit weights as they are). Applies to the attention and MLP projections; embeddings,
    norms and the LM head stay in --dtype."""
    quantization_group_size: int | None = None
    """int4: input channels per scale and zero, 32 | 64 | 128; default: 32 (a GGUF block: the
    default model's Q4_1 blocks rebuilt exactly). A layer whose in_features the size does not
    divide fails at start."""
    quantize_lm_head: bool = False
    """Quantize the LM head too (int8 / int4); the embedding lookup stays in --dtype."""
    cpu_quant_kernel: str = "auto"
    """gguf, and int4 in groups of 32, on CPU: auto (the C++ block kernels where they build
    with AVX2 / AVX512: the Q4_0 / Q4_1 / Q8_0 / IQ4_NL (as Q8_0) projections and the Q4_K /
    Q5_K / Q6_K ones as matmuls over GGUF-style blocks, and a quantized LM head kept as its
    blocks, not a dense fp copy; else torch's int kernels, with K-quants dequantized to fp)
    | blocks | torch."""
    cpu_quant_activation: str = "auto"
    """gguf layers on the CPU block kernels: auto (per layer shape, fp32 or int8 activations,
    whichever a one-off measurement, cached per machine, finds faster at decode; and from how
    many rows a prefill chunk dequantizes and runs one dense matmul, by the same measurement;
    fp32 under --enable-deterministic-inference) | fp32 (today's: fp32 FMAs on the dequantized
    blocks) | int8 (activations quantized to int8 blocks per row, integer dot products, as
    llama.cpp does: AVX512-VNNI / AVX2 / portable; ~0.3% of a dot's size from fp32)."""
    cpu_dense_kernel: str = "auto"
    """fp projections and LM head on CPU: auto (our packed C++ dense matmul where a one-off
    measurement, cached per machine, finds it clearly faster than torch's BLAS at one row and
    no slower at a prefill chunk, as on AMD EPYC; else torch's) | packed | torch. A tied head
    then gets a packed copy beside the embedding."""
    cpu_decode_stack: str = "auto"
    """Eager CPU decode steps: auto (a pure decode batch's decoder layers run as one C++ call,
    model/cpu_decode_stack.py: the same ops in the same order as the modules, so the same
    tokens, without the Python around ~12 ops a layer: a 1B decode step ~6% faster, the
    default model's ~20%; where the model or a layer is one it does not cover, the modules,
    with a log line saying why) | off (the modules always)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant inference on CPU (SGLang's flag): by default greedy output can depend
    on batch composition, cache hits and speculation on/off (a verify's rows round
    differently from one-row decodes), as in SGLang/vLLM without their deterministic mode.
    With it, on CPU, every fp projection and the LM head run our own batch-invariant dense
    matmul (one fixed-order fp32 FMA chain per output, on any CPU and SIMD level; with
    --quantization none the decode step is no slower), int8 / int4 / gguf layers stay on
    their row-wise kernels for prefill chunks too (slower prefill), and the cpu_fused
    attention runs every query (decode, verify, extend, fresh prefill) through its extend
    kernel (the default model's batch-1 decode step: about 13-15% slower). A token's logits
    are then bitwise the same at any batch, cached or not, speculating or not (docs/api.md
    lists every op it covers). Not on CUDA, nor with --attention-backend torch_native (a
    warning)."""
    is_embedding: bool = False
    """Serve the model as an embedding model (SGLang's flag; vLLM's --runner pooling): each
    prompt's embedding is its last token's final-normed hidden state, L2-normalized (the
    pooling of decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral), through
    /encode, /v1/embeddings, Ollama's /api/embed and Engine.encode; generation requests are
    refused. Prompts share the prefix cache as generation does."""

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except (RuntimeError, TypeError) as exc:  # torch's own list of every device type
            raise ValueError(
                f"--device must be auto, cpu, cuda or cuda:N; got {self.device!r}"
            ) from exc

    def quant_compute_dtype(self) -> torch.dtype:
        """The dtype int8 / int4 kernels compute in: with --dtype auto on CPU, bfloat16 (torch's
        int kernels are fast in bfloat16 only) under an fp32 model; else the model's dtype."""
        import torch

        if self.dtype == "auto" and self.torch_device().type == "cpu":
            return torch.bfloat16
        return self.torch_dtype()

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            on_cuda = self.torch_device().type == "cuda"
            return torch.bfloat16 if on_cuda else torch.float32
        return dtype_named(self.dtype, "dtype")
