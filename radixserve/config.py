"""Configuration dataclasses. Each field's docstring is its `--help` text (see cli_args.py)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SPECULATIVE_ALGORITHMS = ("NGRAM", "SELF", "STANDALONE")  # SGLang's names (SELF: ours)
DRAFT_MODEL_ALGORITHMS = ("SELF", "STANDALONE")
PIN_POLICIES = ("hard", "last")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its options is not implemented here."""


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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds a ModelConfig from a parsed HF `config.json`; rejects what we cannot run."""
        arch = _architecture(cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias = {
            "Qwen2ForCausalLM": (True, False),
            "MistralForCausalLM": (False, False),
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(arch, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            hf_config=cfg,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or ["<none>"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        msg = f"unsupported architecture {archs[0]!r}; supported: {supported}"
        raise UnsupportedModelError(msg)
    return archs[0]


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


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    if arch == "MistralForCausalLM":
        return cfg.get("sliding_window")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported")
    return None


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


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
    a GGUF file whose projections are all Q4_0 / Q4_1 / Q8_0, as the default model's are;
    else none, for a GGUF file its dequantized fp copy) | none | int8 (weight-only, a scale
    per output channel) | int4 (weight-only, a scale and zero per group of input
    channels; CUDA: Triton kernel) | fp8 (CUDA, bf16) | gguf (a GGUF file's Q4_0/Q4_1/Q8_0
    blocks as they are, no fp32 detour) | gptq | awq (CPU: a GPTQ / AWQ checkpoint's 4-bit
    weights as they are). Applies to the attention and MLP projections; embeddings, norms and
    the LM head stay in --dtype."""
    quantization_group_size: int | None = None
    """int4: input channels per scale and zero, 32 | 64 | 128; default: per layer, the largest
    of these that divides its in_features."""
    quantize_lm_head: bool = False
    """Quantize the LM head too (int8 / int4); the embedding lookup stays in --dtype."""
    cpu_quant_kernel: str = "auto"
    """gguf on CPU: auto (the C++ block kernels where they build with AVX2 / AVX512: the
    Q4_0 / Q4_1 / Q8_0 projections as fp32 matmuls over GGUF-style blocks, and a quantized LM
    head kept as its blocks, not a dense fp copy; else torch's int kernels) | blocks | torch."""
    enable_deterministic_inference: bool = False
    """Batch-invariant inference on CPU (SGLang's flag): by default greedy output can depend
    on batch composition, cache hits and speculation on/off (a verify's rows round
    differently from one-row decodes), as in SGLang/vLLM without their deterministic mode.
    With it, on CPU, int8 / int4 / gguf layers stay on torch's row-wise kernels for prefill
    chunks too (slower prefill), the fp layers left (the LM head; every projection with
    --quantization none) run one gemm whatever the row count (BatchInvariantLinear: a copy
    of W.T; the default model's batch-1 decode step measured ~20% slower), and the
    cpu_fused attention runs every query (decode, verify, extend, fresh prefill) through its
    extend kernel, whose per-query arithmetic ignores the batch. A token's logits are then
    bitwise the same at any batch, cached or not, speculating or not (docs/performance.md
    has the cost). Not on CUDA, nor with --attention-backend torch_native (a warning)."""

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def quant_compute_dtype(self) -> torch.dtype:
        """The dtype int8 / int4 kernels compute in: with --dtype auto on CPU, bfloat16 (torch's
        int kernels are fast in bfloat16 only) under an fp32 model; else the model's dtype."""
        if self.dtype == "auto" and self.torch_device().type == "cpu":
            return torch.bfloat16
        return self.torch_dtype()

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            on_cuda = self.torch_device().type == "cuda"
            return torch.bfloat16 if on_cuda else torch.float32
        if self.dtype not in TORCH_DTYPES:
            allowed = ", ".join(TORCH_DTYPES)
            raise ValueError(f"dtype must be one of auto, {allowed}; got {self.dtype!r}")
        return TORCH_DTYPES[self.dtype]


KV_EVENT_PUBLISHERS = ("zmq", "null")  # vLLM's names; null: no socket, no events


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, parsed from --kv-events-config (the same JSON keys)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"  # wildcard / ipc / inproc: bind, else connect (vLLM's rule)
    replay_endpoint: str | None = None  # a ROUTER socket resending buffered batches on request
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread; more are dropped
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses and checks the flag's JSON; every error names --kv-events-config."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"--kv-events-config must be a JSON object; got {text!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(
                f"--kv-events-config has unknown keys {unknown}; known: {', '.join(known)}"
            )
        config = cls(**values)
        config.verify()
        return config

    def for_instance(self, index: int) -> KVEventsConfig:
        """The config of data-parallel instance `index` (a fleet worker): its endpoints moved
        by `index`, as vLLM does for its DP ranks, so that instances never share a socket."""
        replay = self.replay_endpoint
        return replace(
            self,
            endpoint=offset_endpoint(self.endpoint, index),
            replay_endpoint=None if replay is None else offset_endpoint(replay, index),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def verify(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config enable_kv_cache_events must be true or false")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            allowed = " | ".join(KV_EVENT_PUBLISHERS)
            raise ValueError(
                f"--kv-events-config publisher must be {allowed}; got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config {name} must be an int >= 1; got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config replay_endpoint must be a string or null")


def offset_endpoint(endpoint: str, offset: int) -> str:
    """A ZMQ endpoint `offset` ports up (tcp), or with `_<offset>` appended (ipc, inproc)."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--kv-events-config endpoint {endpoint!r} has no port")
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}_{offset}"


@dataclass
class CacheConfig:
    """The paged KV pool and how the model runner reads it (attention backend, CUDA graphs)."""

    page_size: int = 16
    """Tokens per KV page. 16 keeps page tables and radix nodes small and suits GPU kernels."""
    max_total_tokens: int | None = None
    """KV pool capacity in tokens; default: sized from the memory budget."""
    mem_fraction_static: float = 0.85
    """On CUDA: fraction of GPU memory for weights + KV pool (+ CUDA graphs, estimated)."""
    cpu_kv_cache_gb: float = 4.0
    """On CPU: GiB of RAM for the KV pool when --max-total-tokens is not given."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, cpu_fused on CPU, torch_native if it cannot build) | torch_native
    (reference, any device) | cpu_fused (C++ paged decode, CPU; built on first use) | triton |
    flashinfer (CUDA, needs `pip install flashinfer-python`)."""
    disable_cuda_graph: bool = False
    """On CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."""
    cuda_graph_max_bs: int = 256
    """Largest decode batch captured as a CUDA graph; larger batches run eagerly."""
    enable_torch_compile: bool = False
    """On CPU (cpu_fused attention): run decode steps compiled by torch.compile (inductor),
    one static shape per padded batch size, each compiled on first use (seconds to a minute;
    inductor caches the code on disk). Falls back to eager, with a log line, where compiling
    fails. Off by default: see docs/performance.md for what it gains."""
    torch_compile_max_bs: int = 32
    """Largest decode batch run compiled (sizes 1, 2, 4, 8, then every 8); larger batches
    run eagerly. SGLang's default."""
    kv_cache_dtype: str = "auto"
    """auto (the model's --dtype) | float32 | bfloat16 | float16. One other than the model's
    dtype needs --attention-backend torch_native or cpu_fused, which cast K/V as they read."""
    kv_events_config: str | None = None
    """KV cache events for KV-aware routers, the flag vLLM and SGLang use: JSON such as
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "topic": ""}'. BlockStored / BlockRemoved / AllBlocksCleared in vLLM's wire format over a
    ZMQ PUB socket (needs pyzmq: the kv-events extra). Default: off."""

    def __post_init__(self) -> None:
        if self.torch_compile_max_bs < 1:
            raise ValueError(
                f"--torch-compile-max-bs must be >= 1; got {self.torch_compile_max_bs}"
            )

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config, or None when events are off."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(self.kv_events_config)
        return config if config.enable_kv_cache_events else None

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model computing in `model_dtype`."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        if self.kv_cache_dtype not in TORCH_DTYPES:
            allowed = ", ".join(TORCH_DTYPES)
            raise ValueError(
                f"--kv-cache-dtype must be auto or one of {allowed}; got {self.kv_cache_dtype!r}"
            )
        return TORCH_DTYPES[self.kv_cache_dtype]


@dataclass
class SchedulerConfig:
    """How the scheduler orders, admits and batches requests."""

    schedule_policy: str = "lpm"
    """lpm (longest cached prefix first, aged) | dfs-weight (DFS over the radix tree) | fcfs."""
    chunked_prefill_size: int = 2048
    """Most prefill tokens one step computes; longer prompts are chunked (-1: no limit)."""
    max_prefill_tokens: int = 16384
    """Most prefill tokens admitted per step (new requests), before chunking."""
    max_running_requests: int = 256
    """Most requests in the running batch."""
    disable_radix_cache: bool = False
    """Share no prefixes: every prompt is computed from scratch."""
    # 64: lpm may still run a whole group of prefix-sharing requests (parallel samples, a
    # fork's children, an agent's tool calls: tens, not hundreds) ahead of a colder request,
    # which then waits behind at most 64 newer ones, a quarter of a default-sized batch. Queue
    # position, not waiting time, so that `bench simulate` reproduces the engine exactly.
    schedule_max_bypass: int = 64
    """Anti-starvation: a waiting request that this many later arrivals were admitted ahead of
    goes first. A bound in requests, not steps, so lpm keeps its order under sustained load."""
    schedule_tier_match_weight: float = 0.0
    """What a cached token in the hierarchical cache's tier counts for in lpm / dfs-weight,
    relative to one in the pool (1 - its load cost / recompute cost; see engine/policy.py);
    0: order by pool hits only."""
    enable_priority_scheduling: bool = False
    """Honour each request's `priority` (an int, higher first, as SGLang): admission order,
    retraction order and eviction order of cached prefixes; aging (schedule_max_bypass) still
    lets a low-priority request through. Off: a request with a non-zero priority is refused."""
    # 0.3: the default; what pins hold is at most this share, so admission always
    # keeps the rest of the pool.
    max_pinned_fraction: float = 0.3
    """Most of the KV pool that retention pins (session retention, POST /cache/pin) may hold;
    past it the oldest pins degrade to plain LRU."""
    pin_policy: str = "hard"
    """hard: pinned pages are never evicted while pinned (admission works around them) |
    last: they count as free for admission but are evicted only after every unpinned page,
    oldest pin first (for pools too small to set pages aside)."""
    schedule_conservativeness: float = 1.0
    """Scales the estimate of output still to come at admission (higher: fewer retractions)."""
    context_length: int | None = None
    """Longest prompt + output; default: the model's max_position_embeddings."""
    disable_jump_forward: bool = False
    """Constrained requests (json_schema / regex / ebnf) sample every token, even where the
    grammar allows only one continuation; default: that continuation is appended unsampled
    (jump-forward) and computed in the next step's extend."""
    speculative_algorithm: str | None = None
    """Speculative decoding, drafts verified in the running batch: NGRAM (looked up in the
    request's own prompt + output and in an n-gram store of recent requests), SELF (the
    target's first --speculative-self-layers layers), STANDALONE (a smaller model,
    --speculative-draft-model-path); default: off."""
    speculative_num_draft_tokens: int = 4
    """Most draft tokens verified per request per step (K: the request computes K + 1)."""
    speculative_num_steps: int | None = None
    """SELF / STANDALONE: draft-model forwards per step, one draft token each; default and
    most: --speculative-num-draft-tokens."""
    speculative_draft_model_path: str | None = None
    """STANDALONE: the draft model (HF folder or GGUF, as --model); it must share the
    target's tokenizer, checked at start."""
    speculative_self_layers: int = 2
    """SELF: how many of the target's first layers draft (then its final norm and LM head)."""
    speculative_adaptive_threshold: float = 1.0
    """Adaptive fallback: a request whose drafts average fewer accepted tokens per verify
    step than this (over its last 2 drafted steps) stops drafting for 16, then 32, ... up
    to 128 decode steps, then retries; 0: never stop. 1: a draft must at least double a
    step's tokens, about what a verify of 4 drafts costs over a decode on CPU."""
    speculative_disable_by_batch_size: int | None = None
    """Decode batches of more requests than this do not speculate (there decode is
    compute-bound: a verify row costs as much as another request's token); default: any."""
    speculative_ngram_min_match_window_size: int = 1
    """NGRAM: shortest suffix of the sequence (in tokens) matched to find a draft."""
    speculative_ngram_max_match_window_size: int = 12
    """NGRAM: longest suffix matched; longer matches are tried first."""
    speculative_ngram_capacity: int = 100_000
    """NGRAM: most n-grams indexed in the store shared by requests; past it, the sequences
    least recently added or drafted from go."""

    def verify(self) -> None:
        policies = ("lpm", "dfs-weight", "fcfs")
        if self.schedule_policy not in policies:
            allowed = ", ".join(policies)
            raise ValueError(
                f"schedule_policy must be one of {allowed}; got {self.schedule_policy!r}"
            )
        if self.pin_policy not in PIN_POLICIES:
            raise ValueError(
                f"pin_policy must be one of {', '.join(PIN_POLICIES)}; got {self.pin_policy!r}"
            )
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"max_pinned_fraction must be in [0, 1]; got {self.max_pinned_fraction}"
            )
        if not 0.0 <= self.schedule_tier_match_weight <= 1.0:
            raise ValueError(
                "schedule_tier_match_weight must be in [0, 1]; "
                f"got {self.schedule_tier_match_weight}"
            )
        for name in ("max_prefill_tokens", "max_running_requests", "schedule_max_bypass"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(
                f"chunked_prefill_size must be -1 or >= 1; got {self.chunked_prefill_size}"
            )
        self._verify_speculative()

    def _verify_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be NGRAM, SELF, STANDALONE or unset; got {algorithm!r}"
            )
        self.speculative_algorithm = algorithm.upper()
        for name in (
            "speculative_num_draft_tokens",
            "speculative_ngram_min_match_window_size",
            "speculative_ngram_capacity",
            "speculative_self_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if high < low:
            raise ValueError(
                "speculative_ngram_max_match_window_size must be >= "
                f"speculative_ngram_min_match_window_size ({low}); got {high}"
            )
        if self.speculative_adaptive_threshold < 0:
            raise ValueError(
                "speculative_adaptive_threshold must be >= 0; "
                f"got {self.speculative_adaptive_threshold}"
            )
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1; got {limit}")
        self._verify_draft_model()

    def _verify_draft_model(self) -> None:
        """The flags of SELF / STANDALONE: each only with the algorithm that reads it."""
        algorithm = self.speculative_algorithm
        steps = self.speculative_num_steps
        if steps is not None and algorithm not in DRAFT_MODEL_ALGORITHMS:
            raise ValueError(
                "speculative_num_steps needs --speculative-algorithm SELF or STANDALONE"
            )
        if steps is not None and not 1 <= steps <= self.speculative_num_draft_tokens:
            raise ValueError(
                "speculative_num_steps must be between 1 and speculative_num_draft_tokens "
                f"({self.speculative_num_draft_tokens}); got {steps}"
            )
        path = self.speculative_draft_model_path
        if algorithm == "STANDALONE" and path is None:
            raise ValueError(
                "speculative_algorithm STANDALONE needs --speculative-draft-model-path"
            )
        if algorithm != "STANDALONE" and path is not None:
            raise ValueError(
                "speculative_draft_model_path needs --speculative-algorithm STANDALONE"
            )

    @property
    def speculative_draft_steps(self) -> int:
        """Draft tokens per proposal of a draft model (SELF / STANDALONE)."""
        return self.speculative_num_steps or self.speculative_num_draft_tokens


HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")  # SGLang's


@dataclass
class HiCacheConfig:
    """The second KV tier below the pool (SGLang's HiCache): host memory, or a memory-mapped
    file under --hicache-dir that also survives a restart."""

    enable_hierarchical_cache: bool = False
    """Keep KV pages evicted from the pool in a host tier and load them back on a hit,
    instead of recomputing them."""
    hicache_ratio: float = 2.0
    """Tier size as a multiple of the KV pool's pages (SGLang's default: 2.0); ignored when
    --hicache-size is given."""
    hicache_size: float = 0.0
    """Tier size in GB (10^9 bytes); 0: sized by --hicache-ratio."""
    hicache_write_policy: str = "write_through"
    """write_through (copy a page to the tier when it enters the radix tree) | write_back
    (copy when it is evicted from the pool) | write_through_selective (copy once its node
    was hit twice: only reused prefixes take tier room)."""
    hicache_dir: str | None = None
    """Folder for the tier's memory-mapped file and its index: a restarted server with the
    same model, page size and KV dtype serves the cached prefixes from it. Default: the tier
    lives in anonymous host memory and dies with the process."""

    def verify(self) -> None:
        """Rejects bad values, naming the flag; creates --hicache-dir if missing."""
        if not self.enable_hierarchical_cache:
            self._verify_unused()
            return
        policy = self.hicache_write_policy
        if policy not in HICACHE_WRITE_POLICIES:
            allowed = " | ".join(HICACHE_WRITE_POLICIES)
            raise ValueError(f"--hicache-write-policy must be one of {allowed}; got {policy!r}")
        if self.hicache_size < 0:
            raise ValueError(
                f"--hicache-size must be > 0 GB (0: use --hicache-ratio); got {self.hicache_size}"
            )
        if self.hicache_ratio <= 0:
            raise ValueError(f"--hicache-ratio must be > 0; got {self.hicache_ratio}")
        if self.hicache_dir is not None:
            _check_writable_dir(self.hicache_dir)

    def _verify_unused(self) -> None:
        for f in fields(self):
            if f.name != "enable_hierarchical_cache" and getattr(self, f.name) != f.default:
                flag = "--" + f.name.replace("_", "-")
                raise ValueError(f"{flag} needs --enable-hierarchical-cache")

    def num_tier_pages(self, pool_pages: int, page_nbytes: int) -> int:
        """Slots of the tier: --hicache-size GB of pages, else --hicache-ratio x the pool."""
        if self.hicache_size > 0:
            num = int(self.hicache_size * 1e9) // page_nbytes
            flag = f"--hicache-size {self.hicache_size}"
        else:
            num = int(self.hicache_ratio * pool_pages)
            flag = f"--hicache-ratio {self.hicache_ratio}"
        if num < 1:
            raise ValueError(f"{flag} holds no KV page of {page_nbytes} bytes; raise it")
        return num


def _check_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--hicache-dir {path!r} cannot be created: {exc}") from exc
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--hicache-dir {path!r} is not a writable folder")


DIST_BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model, and how they talk."""

    tp_size: int = 1
    """Tensor-parallel ranks (processes, one device each); rank 0 runs the scheduler and the
    radix cache, every rank holds 1/tp of the attention heads, MLP and vocabulary."""
    dist_backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo: the torch.distributed backend of
    --tp-size > 1."""
    dist_init_addr: str | None = None
    """host:port where the ranks rendezvous (rank 0 listens there); default: a free loopback
    port. For multi-node later: an address every node reaches."""
    dist_timeout: float = 300.0
    """Seconds a collective (or the rendezvous) may wait for the other ranks before the engine
    stops with an error; a rank that exits is noticed sooner."""

    def verify(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1; got {self.tp_size}")
        if self.dist_backend not in DIST_BACKENDS:
            allowed = ", ".join(DIST_BACKENDS)
            raise ValueError(f"--dist-backend must be one of {allowed}; got {self.dist_backend!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0; got {self.dist_timeout}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dist-init-addr must be host:port; got {self.dist_init_addr!r}")

    def torch_backend(self, device: torch.device) -> str:
        """The backend `auto` means on `device`; nccl only on CUDA."""
        if self.dist_backend == "auto":
            return "nccl" if device.type == "cuda" else "gloo"
        if self.dist_backend == "nccl" and device.type != "cuda":
            raise ValueError(f"--dist-backend nccl needs CUDA; the model runs on {device}")
        return self.dist_backend


DISAGGREGATION_MODES = ("null", "prefill", "decode")  # SGLang's --disaggregation-mode
TRANSFER_BACKENDS = ("tcp", "fake")
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation (SGLang's protocol): sglang-router in PD mode sends each
    request to a prefill and a decode worker with bootstrap_host / _port / _room."""

    disaggregation_mode: str = "null"
    """null (a normal worker) | prefill (computes the prompt, returns after one token and
    serves its KV pages on the bootstrap port) | decode (pulls the prompt's KV pages from the
    prefill worker, then decodes)."""
    disaggregation_bootstrap_port: int = SGLANG_BOOTSTRAP_PORT
    """prefill: the port decode workers pull KV pages from (0: a free one). `fleet`: prefill
    worker i serves on this port + i (0 refused: the router must be told each port)."""
    disaggregation_bootstrap_host: str = "127.0.0.1"
    """prefill: the address the bootstrap port binds; loopback unless told otherwise (as
    --host): decode workers on other machines need a reachable one."""
    disaggregation_transfer_backend: str = "tcp"
    """tcp (pages over TCP, CRC32-checked) | fake (moves nothing: the decode worker computes
    the prompt itself; warm-up and tests)."""
    disaggregation_transfer_timeout: float = 30.0
    """Seconds a decode worker waits for a room's KV pages (and a prefill worker keeps a
    request for them waiting) before the request fails with an error naming the room."""

    @property
    def mode(self) -> str | None:
        """prefill | decode, or None for a normal worker."""
        return None if self.disaggregation_mode == "null" else self.disaggregation_mode

    def verify(self, scheduler: SchedulerConfig, tp_size: int) -> None:
        """Rejects unknown values and combinations disaggregation cannot serve, naming flags."""
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            allowed = " | ".join(DISAGGREGATION_MODES)
            raise ValueError(
                f"--disaggregation-mode must be {allowed}; got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                "--disaggregation-transfer-backend must be tcp | fake; "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ValueError(
                "--disaggregation-bootstrap-port must be in [0, 65535]; "
                f"got {self.disaggregation_bootstrap_port}"
            )
        if self.disaggregation_transfer_timeout <= 0:
            raise ValueError(
                "--disaggregation-transfer-timeout must be > 0; "
                f"got {self.disaggregation_transfer_timeout}"
            )
        if self.mode is not None:
            self._verify_combination(scheduler, tp_size)

    def _verify_combination(self, scheduler: SchedulerConfig, tp_size: int) -> None:
        mode = f"--disaggregation-mode {self.disaggregation_mode}"
        if self.mode == "decode" and scheduler.disable_radix_cache:
            message = "inserts the received KV into the radix tree: drop --disable-radix-cache"
            raise ValueError(f"{mode} {message}")
        if tp_size > 1:
            raise ValueError(f"{mode} moves whole KV pages of one rank: use --tp-size 1")


def split_engine_kwargs(
    model_path: str | None, kwargs: dict[str, Any]
) -> tuple[
    LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig, DisaggregationConfig, HiCacheConfig
]:
    """Distributes flat engine arguments (`page_size=16`, ...) over the config dataclasses."""
    groups = (
        LoadConfig,
        CacheConfig,
        SchedulerConfig,
        ParallelConfig,
        DisaggregationConfig,
        HiCacheConfig,
    )
    values: dict[type, dict[str, Any]] = {cls: {} for cls in groups}
    if model_path is not None:
        values[LoadConfig]["model"] = model_path
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        values[owner][key] = value
    return tuple(cls(**values[cls]) for cls in groups)


@dataclass
class ServerConfig:
    """The HTTP server around the engine core."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 30000
    """Port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on every endpoint but health and metrics."""
    max_queued_requests: int = 1024
    """Requests allowed to wait beyond the running batch; more are answered 503."""
    served_model_name: str | None = None
    """Model name reported by /v1/models and accepted in `model`; default: the model's name."""
    log_level: str = "warning"
    """debug | info | warning | error."""
    max_body_mb: float = 32.0
    """Largest request body accepted, in MiB (larger: 413)."""
    disable_dashboard: bool = False
    """Do not serve the live dashboard at /dashboard (behind --api-key when one is set)."""


ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
"""sglang-router's --policy choices that need no extra setup (`manual` needs routing keys)."""


@dataclass
class FleetConfig:
    """`radixserve fleet`: N `radixserve serve` workers on this machine behind sglang-router,
    or P prefill + D decode workers behind it in PD mode. Workers listen on loopback only; the
    router listens on --host (with --api-key, if set)."""

    workers: int = 2
    """Number of data-parallel workers (each a full `radixserve serve`); ignored when
    --prefill-workers / --decode-workers are set."""
    prefill_workers: int = 0
    """Prefill/decode disaggregation: this many prefill workers (prefill worker i serves its
    KV on --disaggregation-bootstrap-port + i), with --decode-workers; the router runs with
    --pd-disaggregation. 0: a data-parallel fleet of --workers."""
    decode_workers: int = 0
    """Prefill/decode disaggregation: this many decode workers, with --prefill-workers."""
    router_port: int = 30000
    """Port the router listens on: the fleet's one public endpoint."""
    worker_base_port: int = 31000
    """Worker i listens on 127.0.0.1:(worker_base_port + i)."""
    policy: str = "cache_aware"
    """Router policy: cache_aware | round_robin | random | power_of_two."""
    base_gpu_id: int = 0
    """On CUDA: worker i runs on GPU base_gpu_id + i (CUDA_VISIBLE_DEVICES)."""
    cpu_cores_per_worker: int = 1
    """On CPU: worker i is pinned to its own cores (taken in order from this process's
    affinity, wrapping around when there are too few) and runs that many torch threads."""
    router_args: str = ""
    """Extra sglang-router flags, one shell-quoted string, e.g. "--cb-failure-threshold 2
    --health-check-interval-secs 2" for fast failover."""
    startup_timeout_s: float = 600.0
    """Seconds to wait for every worker, then the router, to get healthy."""

    def __post_init__(self) -> None:
        minimums = {
            "workers": 1,
            "cpu_cores_per_worker": 1,
            "base_gpu_id": 0,
            "prefill_workers": 0,
            "decode_workers": 0,
        }
        for name, minimum in minimums.items():
            if getattr(self, name) < minimum:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= {minimum}; got {getattr(self, name)}")
        if self.policy not in ROUTER_POLICIES:
            allowed = " | ".join(ROUTER_POLICIES)
            raise ValueError(f"--policy must be one of {allowed}; got {self.policy!r}")
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise ValueError(
                "--prefill-workers and --decode-workers go together (both >= 1 for a PD "
                f"fleet); got {self.prefill_workers} and {self.decode_workers}"
            )

    @property
    def pd_disaggregation(self) -> bool:
        """Prefill and decode workers behind the router in PD mode."""
        return self.prefill_workers > 0

    @property
    def num_workers(self) -> int:
        return (
            self.prefill_workers + self.decode_workers if self.pd_disaggregation else self.workers
        )

    def worker_mode(self, index: int) -> str | None:
        """Worker `index`'s --disaggregation-mode: prefill workers first, then decode ones;
        None in a data-parallel fleet."""
        if not self.pd_disaggregation:
            return None
        return "prefill" if index < self.prefill_workers else "decode"
