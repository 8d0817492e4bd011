"""ModelConfig: one Llama-family model's shapes and options, read from an HF `config.json`.

Sliding-window attention: `sliding_window` is the window (a token attends to the last
`sliding_window` positions, itself included, as transformers' mask) and `sliding_layers` the
layers that use it; the others attend globally. Mistral: every layer; Qwen2 with
`use_sliding_window`: layers >= `max_window_layers`; Gemma 3: its `layer_types` (five sliding
layers, then one global, by default). Gemma 3's own options are in `GemmaOptions`.

Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) are the same decoder with some MLPs
replaced by a routed set of experts; `MoEConfig` carries their shapes and routing options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
)
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""Checkpoints of the decoder without its LM head (embedding models: e5-mistral, gte-Qwen2,
Qwen3-Embedding saved by AutoModel): served as the causal model with --is-embedding only."""
CLASSIFIER_ARCHITECTURES = {
    f"{family}ForSequenceClassification": f"{family}ForCausalLM"
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
}
"""The decoder with a `score` head over its last token instead of an LM head (reward models:
Skywork-Reward, classifiers): --is-embedding serves their scores."""
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its options is not implemented here."""


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts model (transformers' names in comments)."""

    num_experts: int  # num_experts (Qwen) / num_local_experts (Mixtral)
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size (Qwen) / intermediate_size (Mixtral)
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1 (Mixtral: always)
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is routed; the others are dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none

    @classmethod
    def from_hf_dict(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig:
        """Reads the routing options of `arch`; layers follow transformers' sparse-layer rule:
        not in `mlp_only_layers` and (layer + 1) a multiple of `decoder_sparse_step`."""
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        top_k = cfg.get("num_experts_per_tok") or 0
        if not 0 < top_k <= num_experts:
            raise UnsupportedModelError(
                f"{arch} needs 0 < num_experts_per_tok <= num_experts; got {top_k} of {num_experts}"
            )
        if arch == "MixtralForCausalLM":
            inter, norm, sparse = cfg["intermediate_size"], True, range(cfg["num_hidden_layers"])
        else:
            inter, norm = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
            dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1)
            sparse = [
                i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
            ]
        shared = cfg.get("shared_expert_intermediate_size", 0) if arch.startswith("Qwen2") else 0
        return cls(num_experts, top_k, inter, norm, tuple(sparse), shared or 0)


@dataclass(frozen=True)
class GemmaOptions:
    """What Gemma 3 (text) adds to the Llama layer (transformers' names in comments)."""

    local_rope_theta: float  # rope_local_base_freq: RoPE base of the sliding layers (no scaling)
    query_scale: float  # query_pre_attn_scalar ** -0.5: the attention's softmax scale
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # scaled scores -> cap * tanh(score / cap)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> GemmaOptions:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(name) is not None and not cfg[name] > 0:
                raise UnsupportedModelError(f"Gemma3ForCausalLM needs {name} > 0 or null")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "Gemma3ForCausalLM with use_bidirectional_attention (an embedding model) is "
                "not supported: this runtime decodes causally"
            )
        if (act := cfg.get("hidden_activation", "gelu_pytorch_tanh")) != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"Gemma3ForCausalLM with hidden_activation {act!r}")
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("Gemma 3's sliding layers take default RoPE only")
        theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
        return cls(
            local_rope_theta=float(theta),
            query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one Llama-family model, normalized from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    headless: bool = False  # a BASE_MODEL_ARCHITECTURES checkpoint: no LM head (embeddings only)
    num_labels: int | None = None  # a CLASSIFIER_ARCHITECTURES checkpoint: its score head's outputs
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers attending within `sliding_window`
    gemma: GemmaOptions | None = None  # Gemma 3: norms, scales and RoPE of its own
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # None: a dense model
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds a ModelConfig from a parsed HF `config.json`; rejects what we cannot run."""
        named = (cfg.get("architectures") or [None])[0]
        classifier = named in CLASSIFIER_ARCHITECTURES
        headless = classifier or named in BASE_MODEL_ARCHITECTURES
        arch = _architecture(cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope(_global_rope_fields(arch, cfg))
        window, sliding_layers = _sliding_window(arch, cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias = {
            "Qwen2ForCausalLM": (True, False),
            "Qwen2MoeForCausalLM": (bool(cfg.get("qkv_bias", True)), False),
            "MistralForCausalLM": (False, False),
            "MixtralForCausalLM": (False, False),
        }.get(arch, (attention_bias, attention_bias))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            # headless: the table stands in for the head, whose logits nobody reads
            tie_word_embeddings=headless or bool(cfg.get("tie_word_embeddings", False)),
            headless=headless,
            num_labels=_num_labels(cfg) if classifier else None,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=window,
            sliding_layers=sliding_layers,
            gemma=GemmaOptions.from_hf_dict(cfg) if arch == "Gemma3ForCausalLM" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            moe=MoEConfig.from_hf_dict(arch, cfg) if arch in MOE_ARCHITECTURES else None,
            hf_config=cfg,
        )

    def is_sparse_layer(self, layer: int) -> bool:
        """True where decoder layer `layer`'s MLP is a routed mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`; None: it attends to every position."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attn_logit_cap(self) -> float | None:
        """Soft cap of the attention scores (Gemma's attn_logit_softcapping); None: none."""
        return self.gemma.attn_logit_softcapping if self.gemma is not None else None

    def layer_windows(self) -> tuple[int | None, ...]:
        """`layer_window` of every decoder layer, in order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def is_hybrid(self) -> bool:
        """Some layers slide and some attend globally (Gemma 3, Qwen2 with max_window_layers)."""
        return 0 < len(self.sliding_layers) < self.num_layers

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        itemsize = dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or ["<none>"]
    arch = (BASE_MODEL_ARCHITECTURES | CLASSIFIER_ARCHITECTURES).get(archs[0], archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(
            [*SUPPORTED_ARCHITECTURES, *BASE_MODEL_ARCHITECTURES, *CLASSIFIER_ARCHITECTURES]
        )
        msg = f"unsupported architecture {archs[0]!r}; supported: {supported}"
        raise UnsupportedModelError(msg)
    return arch


def _num_labels(cfg: dict[str, Any]) -> int:
    """A classifier's outputs: transformers' num_labels, read from id2label (2 without it)."""
    labels = cfg.get("id2label") or {}
    return int(cfg.get("num_labels") or len(labels) or 2)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Reads RoPE from either transformers>=5 `rope_parameters` or `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params


def _global_rope_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 keeps RoPE per layer type (transformers>=5: `rope_parameters.full_attention`);
    the global layers' is the model's RoPE, the sliding layers' is in GemmaOptions."""
    params = cfg.get("rope_parameters") or {}
    if arch != "Gemma3ForCausalLM" or "full_attention" not in params:
        return cfg
    return {k: v for k, v in cfg.items() if k != "rope_parameters"} | {
        "rope_parameters": params["full_attention"]
    }


def _sliding_window(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers using it), as transformers applies them; (None, ()) for none."""
    num_layers = cfg["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = cfg.get("sliding_window")
        return window, tuple(range(num_layers)) if window else ()
    if arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        derived = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
        window = cfg.get("sliding_window", 4096)
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", 28)
        derived = ["sliding" if i >= first else "full" for i in range(num_layers)]
        window = cfg.get("sliding_window", 4096)  # null: transformers slides nowhere
    elif cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported")
    else:
        return None, ()
    types = cfg.get("layer_types") or [f"{t}_attention" for t in derived]
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, layers) if window and layers else (None, ())


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
