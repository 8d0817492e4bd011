"""SchedulerConfig: how the scheduler orders, admits and batches requests, speculation included
(the speculative flags live here: speculation runs in the scheduler's decode phase)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# SGLang's names (SELF, AUTO: ours)
SPECULATIVE_ALGORITHMS = ("NGRAM", "SELF", "STANDALONE", "SUFFIX", "EAGLE", "EAGLE3", "AUTO")
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")  # a head over the target's hidden states
DRAFT_MODEL_ALGORITHMS = ("SELF", "STANDALONE", *EAGLE_ALGORITHMS)
DRAFT_PATH_ALGORITHMS = ("STANDALONE", *EAGLE_ALGORITHMS)  # need --speculative-draft-model-path
EAGLE3_AUTO_NUM_STEPS = 3  # SGLang's auto choice for topk 1: 3 steps, 4 draft tokens w/ root
PIN_POLICIES = ("hard", "last")


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
    # 4096: a pin costs a dict entry and a node reference; the count bounds what clients can
    # name (the page bound above already bounds what pins hold).
    max_pins: int = 4096
    """Most retention pins at once, sessions and prefixes together. A new one past it ends the
    oldest session pin; with only prefix pins live it is refused (POST /cache/pin: 429)."""
    pin_policy: str = "hard"
    """hard: pinned pages are never evicted while pinned (admission works around them) |
    last: they count as free for admission but are evicted only after every unpinned page,
    oldest pin first (for pools too small to set pages aside)."""
    schedule_conservativeness: float = 1.0
    """Scales the estimate of output still to come at admission (higher: fewer retractions)."""
    context_length: int | None = None
    """Longest prompt + output (>= 1; its RoPE table must fit in memory); default: the model's
    max_position_embeddings."""
    # 64: a compiled grammar of a 50k-token vocabulary holds its token-mask cache (up to a
    # few MB); recompiling one evicted takes about a second on the grammar thread.
    grammar_cache_size: int = 64
    """Most compiled grammars (json_schema / regex / ebnf, failed compiles included) kept for
    reuse, least recently used dropped first."""
    stream_interval: int = 1
    """Send a request's new tokens to its caller every this many tokens (its first token and
    its end at once; SGLang's); a request's sampling_params.stream_interval overrides it.
    Larger: fewer, bigger stream chunks and less traffic between the core and the server."""
    disable_jump_forward: bool = False
    """Constrained requests (json_schema / regex / ebnf) sample every token, even where the
    grammar allows only one continuation; default: that continuation is appended unsampled
    (jump-forward) and computed in the next step's extend."""
    speculative_algorithm: str | None = None
    """Speculative decoding, drafts verified in the running batch: NGRAM (looked up in the
    request's own prompt + output and in an n-gram store of recent requests), SELF (the
    target's first --speculative-self-layers layers), STANDALONE (a smaller model,
    --speculative-draft-model-path), SUFFIX (suffix trees over the request's own prompt +
    output and over the outputs of recent requests, --speculative-suffix-*), EAGLE3 (an
    EAGLE-3 head reading the target's hidden states, --speculative-draft-model-path), EAGLE
    (an EAGLE-1/2 head reading its final hidden states, the same flags), AUTO
    (ours: per request, whichever of NGRAM, SUFFIX and, given a head at
    --speculative-draft-model-path, EAGLE3 has been accepting best); default: off."""
    speculative_num_draft_tokens: int = 4
    """Most draft tokens verified per request per step (K: the request computes K + 1)."""
    speculative_num_steps: int | None = None
    """SELF / STANDALONE / EAGLE / EAGLE3 (AUTO's too): draft-model forwards per step, one
    draft token each; default: --speculative-num-draft-tokens (EAGLE*: 3, SGLang's auto), at
    most that."""
    speculative_eagle_topk: int | None = None
    """EAGLE / EAGLE3 (AUTO's too, given a head): candidates per draft step; 1 (the default):
    a chain of --speculative-num-steps tokens; k > 1 (not AUTO): a tree (each step expands the top
    k of each of the k best frontier nodes) of --speculative-num-draft-tokens nodes counting
    the root, as SGLang's."""
    speculative_draft_model_path: str | None = None
    """STANDALONE: the draft model (HF folder or GGUF, as --model); it must share the
    target's tokenizer, checked at start. EAGLE3, and AUTO's EAGLE3 candidate (optional):
    the head's folder (config.json and safetensors in SGLang's layout, as SpecForge writes
    them). EAGLE: an EAGLE-1/2 head's folder (fc + layers.0, SGLang's llama_eagle.py)."""
    speculative_self_layers: int = 2
    """SELF: how many of the target's first layers draft (then its final norm and LM head)."""
    speculative_adaptive_threshold: float = 1.0
    """Adaptive fallback: a request whose drafts average fewer accepted tokens per verify
    step than this (over its last 2 drafted steps), or (on CPU) whose tokens do not cover
    those steps' cost (1 + 0.25 k decode steps for k drafts, measured), stops drafting for
    16, then 32, ... up to 128 decode steps, then retries with 1-token drafts until a window
    pays again; 0: never stop. 1: a draft must at least double a step's tokens, what a
    verify of 4 drafts costs over a decode on CPU."""
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
    speculative_suffix_max_tree_depth: int = 24
    """SUFFIX: depth of the suffix trees: the longest match plus draft, in tokens."""
    speculative_suffix_max_spec_factor: float = 1.0
    """SUFFIX: a match of m tokens drafts at most max_spec_factor * m tokens (and at most
    --speculative-num-draft-tokens)."""
    speculative_suffix_min_token_prob: float = 0.1
    """SUFFIX: a draft stops before a token whose estimated probability (the product of
    the empirical frequencies along the path) is below this."""
    speculative_suffix_max_cached_requests: int = 10000
    """SUFFIX: most finished requests whose outputs the shared tree holds (all namespaces
    together); past it the least recently used go; 0: no shared tree, own sequence only."""
    # 262144 (about 2000 outputs of 128 tokens): a lookup scans its namespace's outputs once,
    # a fraction of a millisecond at this size (benchmarks/suffix_lookup.py)
    speculative_suffix_max_cached_tokens: int = 262_144
    """SUFFIX (ours): most output tokens the shared tree holds; past it the least recently
    used outputs go, whole."""

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
        for name in ("max_pins", "grammar_cache_size", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
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
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(
                f"context_length must be >= 1 (unset: the model's); got {self.context_length}"
            )
        if not 0 <= self.schedule_conservativeness < math.inf:
            raise ValueError(
                "schedule_conservativeness must be a number >= 0; "
                f"got {self.schedule_conservativeness}"
            )
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(
                f"chunked_prefill_size must be -1 or >= 1; got {self.chunked_prefill_size}"
            )
        self._verify_speculative()

    def _verify_speculative(self) -> None:
        """The speculative flags' ranges, checked with speculation off too (an out-of-range
        value is refused, not ignored); then the algorithm and its companions."""
        self._verify_speculative_ranges()
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            names = ", ".join(SPECULATIVE_ALGORITHMS)
            raise ValueError(f"speculative_algorithm must be {names} or unset; got {algorithm!r}")
        self.speculative_algorithm = algorithm.upper()
        self._verify_draft_model()

    def _verify_speculative_ranges(self) -> None:
        for name in (
            "speculative_num_draft_tokens",
            "speculative_ngram_min_match_window_size",
            "speculative_ngram_capacity",
            "speculative_self_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("speculative_num_steps", "speculative_eagle_topk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if high < low:
            raise ValueError(
                "speculative_ngram_max_match_window_size must be >= "
                f"speculative_ngram_min_match_window_size ({low}); got {high}"
            )
        if not self.speculative_adaptive_threshold >= 0:
            raise ValueError(
                "speculative_adaptive_threshold must be >= 0; "
                f"got {self.speculative_adaptive_threshold}"
            )
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1; got {limit}")
        self._verify_suffix()

    def _verify_suffix(self) -> None:
        """The SUFFIX flags' ranges (SGLang / vLLM's; a negative request bound, arctic's
        "unbounded", is refused: the store must stay bounded)."""
        for name, low in (
            ("speculative_suffix_max_tree_depth", 2),
            ("speculative_suffix_max_cached_requests", 0),
            ("speculative_suffix_max_cached_tokens", 1),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}; got {getattr(self, name)}")
        if not 0 < self.speculative_suffix_max_spec_factor < math.inf:
            raise ValueError(
                "speculative_suffix_max_spec_factor must be > 0; "
                f"got {self.speculative_suffix_max_spec_factor}"
            )
        if not 0.0 <= self.speculative_suffix_min_token_prob <= 1.0:
            raise ValueError(
                "speculative_suffix_min_token_prob must be in [0, 1]; "
                f"got {self.speculative_suffix_min_token_prob}"
            )

    def _verify_draft_model(self) -> None:
        """The flags of SELF / STANDALONE / EAGLE*: each only with the algorithm that reads it
        (AUTO reads the EAGLE3 ones when given a head)."""
        algorithm = self.speculative_algorithm
        steps = self.speculative_num_steps
        if steps is not None and self.speculative_model_algorithm is None:
            raise ValueError(
                "speculative_num_steps needs --speculative-algorithm SELF, STANDALONE, EAGLE or "
                "EAGLE3 "
                "(or AUTO with --speculative-draft-model-path)"
            )
        if steps is not None and not 1 <= steps <= self.speculative_num_draft_tokens:
            raise ValueError(
                "speculative_num_steps must be between 1 and speculative_num_draft_tokens "
                f"({self.speculative_num_draft_tokens}); got {steps}"
            )
        path = self.speculative_draft_model_path
        if algorithm in DRAFT_PATH_ALGORITHMS and path is None:
            shipped = " (a head ships for the default model only)" if algorithm == "EAGLE3" else ""
            raise ValueError(
                f"speculative_algorithm {algorithm} needs --speculative-draft-model-path{shipped}"
            )
        if algorithm not in (*DRAFT_PATH_ALGORITHMS, "AUTO") and path is not None:
            raise ValueError(
                "speculative_draft_model_path needs --speculative-algorithm STANDALONE, EAGLE, "
                "EAGLE3 or AUTO"
            )
        self._verify_eagle_topk()

    def _verify_eagle_topk(self) -> None:
        topk = self.speculative_eagle_topk
        if topk is None:
            return
        if self.speculative_model_algorithm not in EAGLE_ALGORITHMS:
            raise ValueError(
                "speculative_eagle_topk needs --speculative-algorithm EAGLE or EAGLE3 "
                "(or AUTO with --speculative-draft-model-path)"
            )
        if topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1; got {topk}")
        if topk == 1:
            return
        if self.speculative_algorithm == "AUTO":
            raise ValueError(
                "speculative_eagle_topk > 1 (tree drafting) needs --speculative-algorithm "
                "EAGLE or EAGLE3; AUTO drafts chains"
            )
        # a tree: --speculative-num-draft-tokens counts its nodes with the root, as SGLang's
        steps, nodes = self.speculative_draft_steps, self.speculative_num_draft_tokens
        most = 1 + topk + (steps - 1) * topk * topk  # the root and every candidate
        if not 2 <= nodes <= most:
            raise ValueError(
                f"speculative_num_draft_tokens must be between 2 and {most} (the root and "
                f"every candidate of {steps} steps of --speculative-eagle-topk {topk}) for "
                f"tree drafting; got {nodes}"
            )

    @property
    def speculative_model_algorithm(self) -> str | None:
        """The algorithm that drafts with a model: SELF / STANDALONE / EAGLE* themselves,
        EAGLE3 for AUTO given a head; None: lookups only (or speculation off)."""
        algorithm = self.speculative_algorithm
        if algorithm == "AUTO" and self.speculative_draft_model_path is not None:
            return "EAGLE3"
        return algorithm if algorithm in DRAFT_MODEL_ALGORITHMS else None

    @property
    def speculative_draft_steps(self) -> int:
        """Draft tokens per proposal of a draft model (SELF / STANDALONE / EAGLE*)."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_model_algorithm in EAGLE_ALGORITHMS:
            return min(EAGLE3_AUTO_NUM_STEPS, self.speculative_num_draft_tokens)
        return self.speculative_num_draft_tokens
