"""KVEventsConfig: KV cache events for KV-aware routers (vLLM's --kv-events-config)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

KV_EVENT_PUBLISHERS = ("zmq", "null")  # vLLM's names; null: no socket, no events
# neither endpoint nor bind given: bind vLLM's port on loopback only (vLLM binds every
# interface, and the events carry every tenant's token ids)
DEFAULT_BIND = "tcp://127.0.0.1:5557"
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, parsed from --kv-events-config (the same JSON keys), plus our
    `bind`, `include_token_ids` and `max_replays_per_s`."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    # vLLM's rule: a wildcard (`*`, `::`), ipc or inproc endpoint is bound, any other is
    # connected to (a subscriber that binds); None: `bind`, else DEFAULT_BIND (loopback)
    endpoint: str | None = None
    bind: str | None = None  # ours: an address to bind whatever its host (tcp://127.0.0.1:N)
    replay_endpoint: str | None = None  # a ROUTER socket resending buffered batches on request
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread; more are dropped
    topic: str = ""
    include_token_ids: bool = True  # ours: false sends BlockStored with token_ids [] (hashes)
    max_replays_per_s: int = 10  # ours: replay requests answered in full per second, overall

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
        bind = self.bind if self.endpoint is not None or self.bind is not None else DEFAULT_BIND
        return replace(
            self,
            endpoint=None if self.endpoint is None else offset_endpoint(self.endpoint, index),
            bind=None if bind is None else offset_endpoint(bind, index),
            replay_endpoint=None if replay is None else offset_endpoint(replay, index),
        )

    def pub_address(self) -> tuple[str, bool]:
        """The PUB socket's address and whether it binds there (else it connects)."""
        if self.bind is not None:
            return self.bind, True
        if self.endpoint is not None:
            return self.endpoint, binds(self.endpoint)
        return DEFAULT_BIND, True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def verify(self) -> None:
        for name in ("enable_kv_cache_events", "include_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"--kv-events-config {name} must be true or false")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            allowed = " | ".join(KV_EVENT_PUBLISHERS)
            raise ValueError(
                f"--kv-events-config publisher must be {allowed}; got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size", "max_replays_per_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config {name} must be an int >= 1; got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError("--kv-events-config topic must be a string")
        for name in ("endpoint", "bind", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(ZMQ_SCHEMES)):
                schemes = ", ".join(ZMQ_SCHEMES)
                raise ValueError(
                    f"--kv-events-config {name} must be a ZMQ address ({schemes}) or null; "
                    f"got {value!r}"
                )
        if self.endpoint is not None and self.bind is not None:
            raise ValueError(
                "--kv-events-config takes endpoint (vLLM's rule: a wildcard host binds, others "
                "connect) or bind (bound as given), not both"
            )


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc or inproc endpoint is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


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
