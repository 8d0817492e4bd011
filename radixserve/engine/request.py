"""Req: one generation request as the scheduler sees it.

A request's sequence is `input_ids + output_ids`. Its KV covers the first `num_computed`
tokens, through `page_table`. Each step extends it towards the full sequence: several
tokens while prefilling (chunked under the step budget), one token while decoding; after a
retraction `num_computed` drops to 0 and the same loop recomputes what the cache lost.
Which of its pages the request owns is engine/req_pages.py's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from radixserve.engine.protocol import (
    Bootstrap,
    FinishReason,
    PinRequest,
    RequestSpec,
    SpecCounts,
)
from radixserve.sampling.params import SamplingParams

LORA_NAMESPACE_SEP = "\x00"
"""Joins a LoRA load id and the salt into a cache namespace; salts may not hold it with LoRA
on (client/request_builder.py), so the join is injective."""
MAX_LOGPROBS = 20
"""Most top logprobs per token a request may ask for (vLLM's default max_logprobs), on the
native and the OpenAI API alike."""


def cache_namespace(salt: str | None, lora_id: int | None) -> str | None:
    """The radix tree namespace of a request: its salt, and for an adapter's request the
    adapter's load id too, so its KV never serves the base, another adapter (or another load
    of it) or another tenant. Only the tree sees it: the caller side keys a request (rids,
    pins shown) by the salt alone."""
    if lora_id is None:
        return salt
    parts = ["lora", str(lora_id)] + ([] if salt is None else [salt])
    return LORA_NAMESPACE_SEP.join(parts)


class ReqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class LogprobRequest:
    """What logprobs a request wants, in SGLang's terms."""

    start_len: int = -1  # first prompt position with an input logprob; -1: output only
    top_num: int = 0
    token_ids: tuple[int, ...] = ()  # SGLang's token_ids_logprob: reported at every position
    ranks: bool = False  # each scored prompt token's rank among the vocabulary (1: the top)


@dataclass(eq=False)
class Req:
    rid: str  # the caller's id, for logs
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None  # the cache namespace (`cache_namespace`)
    logprob: LogprobRequest | None = None
    priority: int = 0  # higher first, with --enable-priority-scheduling
    session_id: str | None = None
    pin: PinRequest | None = None  # retention: pin the sequence when it finishes
    bootstrap: Bootstrap | None = None  # disaggregation: the room its prompt's KV goes by
    request_id: str = ""  # unique within the engine; defaults to rid (direct scheduler users)
    lora_id: int | None = None  # its LoRA adapter's load id; `namespace` keeps its KV apart
    embed: bool = False  # prefill only; ends with `embedding` (RequestSpec.embed)
    embedding: bytes | None = None  # the prompt's last final-normed hidden state, float32 LE
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING

    # KV bookkeeping
    page_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: Any = None
    num_computed: int = 0
    num_sliding_freed: int = 0  # page-table entries before this have no sliding K/V (swa_pool)

    # results and accounting
    cached_tokens: int = 0
    cached_tokens_host: int = 0  # of those, loaded back from the hierarchical cache's tier
    finish_reason: FinishReason | None = None
    abort_requested: bool = False
    num_bypassed: int = 0  # later arrivals admitted while it waited (policy.py's aging)
    num_retractions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None
    queue_time: float | None = None  # seconds from arrival to first admission
    grammar: Any = field(default=None, repr=False)  # xgrammar matcher of a constrained request
    grammar_future: Any = field(default=None, repr=False)  # its compilation, while pending
    kv_future: Any = field(default=None, repr=False)  # disaggregated decode: its KV's fetch
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # None: a forced token that ended the request uncomputed (engine/logprobs.py)
    output_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ranks: list[int | None] = field(default_factory=list)  # with logprob.ranks
    output_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    spec_counts: SpecCounts | None = None  # set by the scheduler when the request speculates
    jump_forward_tokens: int = 0  # output tokens its grammar forced (sampling/jump_forward.py)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.rid

    @classmethod
    def from_spec(cls, spec: RequestSpec) -> Req:
        logprob = None
        if spec.logprob_start_len is not None:
            ids = tuple(spec.token_ids_logprob or ())
            logprob = LogprobRequest(
                spec.logprob_start_len, spec.top_logprobs_num, ids, spec.input_ranks
            )
        return cls(
            request_id=spec.request_id,
            rid=spec.rid,
            input_ids=list(spec.input_ids),
            params=spec.params,
            seed=spec.seed,
            namespace=cache_namespace(spec.namespace, spec.lora_id),
            logprob=logprob,
            priority=spec.priority,
            session_id=spec.session_id,
            pin=spec.pin,
            bootstrap=spec.bootstrap,
            lora_id=spec.lora_id,
            embed=spec.embed,
        )

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def seq_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob is not None and self.logprob.start_len >= 0

    def own_pages(self) -> list[int]:
        return self.page_table[self.num_tree_pages :]

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.state = ReqState.FINISHED
        self.finish_time = time.perf_counter()
