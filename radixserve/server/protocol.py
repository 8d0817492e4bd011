"""Messages between the HTTP process and the engine core process (msgpack via msgspec).

server -> core: AddRequest, AbortRequest, Call (flush_cache, get_stats, check_integrity)
core -> server: Ready (once), StepUpdates (one per engine step), CallResult
Token updates are deltas: the server accumulates them into its own copy of the request.
"""

from __future__ import annotations

from typing import Any

import msgspec


class AddRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # already validated by the server
    seed: int
    namespace: str | None = None
    logprob_start_len: int | None = None  # None: no logprobs
    top_logprobs_num: int = 0


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class Call(msgspec.Struct, tag=True):
    call_id: int
    method: str  # flush_cache | get_stats | check_integrity


class ReqUpdate(msgspec.Struct):
    rid: str
    new_output_ids: list[int]
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None
    queue_time: float | None = None
    new_input_logprobs: list[tuple[float | None, int]] = []
    new_input_top_logprobs: list[list[tuple[float, int]] | None] = []
    new_output_logprobs: list[tuple[float, int]] = []
    new_output_top_logprobs: list[list[tuple[float, int]]] = []


class StepUpdates(msgspec.Struct, tag=True):
    updates: list[ReqUpdate]


class CallResult(msgspec.Struct, tag=True):
    call_id: int
    value: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag=True):
    info: dict[str, Any]


ToCore = AddRequest | AbortRequest | Call
FromCore = StepUpdates | CallResult | Ready

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
