"""What crosses between a caller and the engine core: one `RequestSpec` in, `RequestOutput`
deltas out (one per step that changed the request), the last one with a typed finish reason.

The scheduler's `Req` never leaves the core. A new per-token field is added to
`RequestOutput` here, filled in once on the core side (engine/deltas.py) and applied once on
the caller side (`RequestResult.apply` in engine/output.py).

    caller                                   core
    RequestSpec ----------- AddRequests --->  Req (scheduler)
    RequestResult <-- StepOutputs (deltas) --  step()
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from radixserve.sampling.params import SamplingParams


class Finish(msgspec.Struct, frozen=True, tag_field="type"):
    """Why a request ended; serializes as SGLang's `{"type": ..., ...}` dict."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class FinishStop(Finish, frozen=True, tag="stop"):
    """EOS, a stop token id, a stop string or the end of a grammar."""

    matched: int | str | None = None
    kind: ClassVar[str] = "stop"


class FinishLength(Finish, frozen=True, tag="length"):
    """max_new_tokens reached."""

    length: int = 0
    kind: ClassVar[str] = "length"


class FinishAbort(Finish, frozen=True, tag="abort"):
    """Aborted: by the client, or because handling this request failed (`message` says why)."""

    message: str = ""
    status_code: int | None = None
    kind: ClassVar[str] = "abort"


FinishReason = FinishStop | FinishLength | FinishAbort

ABORTED_BY_CLIENT = FinishAbort("aborted by the client")

LogprobEntry = tuple[float | None, int]  # (logprob, token id); None: no logits predict it
TopLogprobs = list[tuple[float, int]] | None


class RequestSpec(msgspec.Struct, frozen=True):
    """A validated request, as the core receives it."""

    request_id: str  # unique per engine: outputs and aborts are routed by it
    rid: str  # the caller's id (SGLang's `rid`), reported back as meta_info["id"]
    input_ids: list[int]
    params: SamplingParams
    seed: int
    namespace: str | None = None  # cache namespace (cache_salt): shares prefixes only within
    logprob_start_len: int | None = None  # None: no logprobs; -1: output logprobs only
    top_logprobs_num: int = 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprob_start_len is not None


class RequestOutput(msgspec.Struct):
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int] = []
    cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first admission, once known
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    new_input_logprobs: list[LogprobEntry] = []
    new_input_top_logprobs: list[TopLogprobs] = []
    new_output_logprobs: list[LogprobEntry] = []
    new_output_top_logprobs: list[TopLogprobs] = []


# ---- messages between a client and its core (a thread or a process) ------------------------


class AddRequests(msgspec.Struct, tag=True):
    specs: list[RequestSpec]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True):
    call_id: int
    method: str  # one of CALL_METHODS


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]


class CallResult(msgspec.Struct, tag=True):
    call_id: int
    value: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag=True):
    info: dict[str, Any]


CALL_METHODS = ("flush_cache", "get_stats", "check_integrity")
ToCore = AddRequests | AbortRequests | Call
FromCore = StepOutputs | CallResult | Ready

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
