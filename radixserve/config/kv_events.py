"""KVEventsConfig: KV cache events for KV-aware routers (vLLM's --kv-events-config)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

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
