"""What crosses between a caller and the engine core: one `RequestSpec` in, `RequestOutput`
deltas out (one per step that changed the request), the last one with a typed finish reason.

The scheduler's `Req` never leaves the core. These are plain dataclasses: the in-process core
passes them as they are; engine/wire.py encodes them for the core process's pipe (the one
module here that needs msgspec; both ends of the pipe import it). A new per-token field is
added to `RequestOutput` here, filled in once on the core side (engine/deltas.py) and applied
once on the caller side (`RequestResult.apply` in client/result.py).

    caller                                   core
    RequestSpec ----------- AddRequests --->  Req (scheduler)
    RequestResult <-- StepOutputs (deltas) --  step()
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: `stop` (EOS, a stop token or string, the end of a grammar),
    `length` (max_new_tokens), or `abort` (by the client, or handling it failed: `message`)."""

    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop: the token id or stop string
    length: int | None = None  # length: max_new_tokens
    message: str | None = None  # abort: why
    status_code: int | None = None  # abort: the HTTP status it maps to, when not the client's

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str, status_code: int | None = None) -> FinishReason:
        return cls("abort", message=message, status_code=status_code)

    @property
    def is_abort(self) -> bool:
        return self.kind == "abort"

    def to_dict(self) -> dict[str, Any]:
        """SGLang's finish_reason dict."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


ABORTED_BY_CLIENT = FinishReason.abort("aborted by the client")


@dataclass
class SpecCounts:
    """A speculating request's totals so far, reported in meta_info as SGLang's `spec_*`.
    Every decode step of such a request verifies a draft (possibly empty)."""

    verify_ct: int = 0  # decode steps (verify forwards) of the request
    draft_tokens: int = 0  # draft tokens proposed and verified
    accepted_tokens: int = 0  # draft tokens accepted
    # per algorithm that drafted (AUTO picks one per step; "none": a step without a draft)
    drafter_verify_ct: dict[str, int] = field(default_factory=dict)
    drafter_accepted_tokens: dict[str, int] = field(default_factory=dict)

    def count(self, source: str, num_draft: int, num_accepted: int) -> None:
        """One decode step whose draft (possibly empty) `source` proposed."""
        self.verify_ct += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        self.drafter_verify_ct[source] = self.drafter_verify_ct.get(source, 0) + 1
        accepted = self.drafter_accepted_tokens.get(source, 0) + num_accepted
        self.drafter_accepted_tokens[source] = accepted

    def copy(self) -> SpecCounts:
        """A snapshot that later steps do not change (the dicts copied too)."""
        return replace(
            self,
            drafter_verify_ct=dict(self.drafter_verify_ct),
            drafter_accepted_tokens=dict(self.drafter_accepted_tokens),
        )

    def meta_info(self, completion_tokens: int) -> dict[str, Any]:
        """SGLang's names; accept length = completion tokens per verify step. Ours: the
        `spec_drafter_*` counts by the algorithm that drafted (AUTO's choice per step)."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": completion_tokens / self.verify_ct if self.verify_ct else 0.0,
            "spec_accept_rate": (
                self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            ),
            "spec_accept_token_num": self.accepted_tokens,
            "spec_draft_token_num": self.draft_tokens,
            "spec_drafter_verify_ct": dict(self.drafter_verify_ct),
            "spec_drafter_accept_token_num": dict(self.drafter_accepted_tokens),
        }


LogprobEntry = tuple[float | None, int]  # (logprob, token id); None: no logits predict it
TopLogprobs = list[tuple[float, int]] | None


@dataclass(frozen=True)
class PinRequest:
    """Keep the request's prompt + output pinned in the cache when it finishes (see
    cache/retention.py): under `key`, for `ttl_s` seconds (None: until unpinned)."""

    key: str  # session:<id> | prefix:<name>
    ttl_s: float | None = None


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's KV comes from (SGLang's bootstrap fields, written by
    sglang-router in PD mode): the prefill worker's host and bootstrap port, and the room
    that pairs its prefill with its decode."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class RequestSpec:
    """A validated request, as the core receives it."""

    request_id: str  # unique per engine: outputs and aborts are routed by it
    rid: str  # the caller's id (SGLang's `rid`), reported back as meta_info["id"]
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None  # cache namespace (cache_salt): shares prefixes only within
    logprob_start_len: int | None = None  # None: no logprobs; -1: output logprobs only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # ids whose logprobs every position reports
    input_ranks: bool = False  # each scored prompt token's rank too (vLLM's prompt_logprobs)
    priority: int = 0  # higher first (SGLang's field); needs --enable-priority-scheduling
    lora_id: int | None = None  # load id of its LoRA adapter (model/lora.py); None: the base
    session_id: str | None = None  # admitting it ends the session's previous retention pin
    pin: PinRequest | None = None  # retention: pin what it leaves in the cache
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation: the KV's room
    embed: bool = False  # an embedding: the prompt's last final-normed hidden state, no tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprob_start_len is not None


@dataclass
class RequestOutput:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    cached_tokens_host: int = 0  # of cached_tokens, loaded back from the hierarchical tier
    queue_time: float | None = None  # seconds from arrival to first admission, once known
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    new_input_logprobs: list[LogprobEntry] = field(default_factory=list)
    new_input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    new_output_logprobs: list[LogprobEntry] = field(default_factory=list)
    new_output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    new_input_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    new_input_ranks: list[int | None] = field(default_factory=list)  # with input_ranks
    new_output_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    spec_counts: SpecCounts | None = None  # totals so far; None: the request does not speculate
    jump_forward_tokens: int = 0  # total so far: output tokens its grammar forced, unsampled
    embedding: bytes | None = None  # an embed request's last hidden state: float32, little-endian


# ---- messages between a client and its core (a thread, or a process: engine/wire.py) -------


@dataclass
class AddRequests:
    specs: list[RequestSpec]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Call:
    call_id: int
    method: str  # flush_cache | get_stats | check_integrity | tree_summary | ... (CoreLoop._call)
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the method


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass
class CallResult:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class Ready:
    info: dict[str, Any]


@dataclass
class StartFailed:
    """The core could not start (a flag refused, a model that does not load): why, as
    `ExceptionType: message`, sent instead of Ready before the core exits."""

    error: str


ToCore = AddRequests | AbortRequests | Call
FromCore = StepOutputs | CallResult | Ready | StartFailed
