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

from radixserve.sampling.params import SamplingParams


class ReqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class LogprobRequest:
    """What logprobs a request wants, in SGLang's terms."""

    start_len: int = -1  # first prompt position with an input logprob; -1: output only
    top_num: int = 0


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None
    logprob: LogprobRequest | None = None
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING

    # KV bookkeeping
    page_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: Any = None
    num_computed: int = 0

    # results and accounting
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    abort_requested: bool = False
    num_bypassed: int = 0  # later arrivals admitted while it waited (policy.py's aging)
    num_retractions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None
    queue_time: float | None = None  # seconds from arrival to first admission
    detokenizer: Any = field(default=None, repr=False)  # set by engine/output.py
    grammar: Any = field(default=None, repr=False)  # xgrammar matcher of a constrained request
    grammar_future: Any = field(default=None, repr=False)  # its compilation, while pending
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

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

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self.state = ReqState.FINISHED
        self.finish_time = time.perf_counter()
