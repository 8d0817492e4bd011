"""msgpack for the pipe between a caller (client/core_client.py) and its core process
(core_process.py): each message is sent as [type name, payload], and the payload is decoded
straight into its protocol.py type. It sits beside protocol.py, not in client/, because both
ends of the pipe use it and the core never imports the caller side."""

from __future__ import annotations

import msgspec

from radixserve.engine.protocol import (
    AbortRequests,
    AddRequests,
    Call,
    CallResult,
    FromCore,
    Ready,
    StartFailed,
    StepOutputs,
    ToCore,
)

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_to_core = {
    cls.__name__: msgspec.msgpack.Decoder(cls) for cls in (AddRequests, AbortRequests, Call)
}
_from_core = {
    cls.__name__: msgspec.msgpack.Decoder(cls)
    for cls in (StepOutputs, CallResult, Ready, StartFailed)
}


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode((type(message).__name__, message))


def decode_to_core(data: bytes) -> ToCore:
    return _decode(data, _to_core)


def decode_from_core(data: bytes) -> FromCore:
    return _decode(data, _from_core)


def _decode(data: bytes, decoders: dict[str, msgspec.msgpack.Decoder]):
    name, payload = _envelope.decode(data)
    if name not in decoders:
        raise ValueError(f"unexpected message {name!r} on the core pipe")
    return decoders[name].decode(payload)
