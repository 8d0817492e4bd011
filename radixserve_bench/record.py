"""What a benchmark records: one `RequestResult` per request, one `BenchRun` per system."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """Timings and token counts of one request, as the client saw them."""

    index: int
    turn: int = 0
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    start_time: float = 0.0
    """When the request was sent, in seconds since the benchmark started."""
    e2e: float = 0.0
    """Seconds from sending to the last token."""
    chunk_times: list[float] = field(default_factory=list)
    """Seconds from sending to each streamed chunk that carried new tokens."""
    chunk_tokens: list[int] = field(default_factory=list)
    """How many new tokens each of those chunks carried."""
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)

    def add_chunk(self, elapsed: float, num_tokens: int) -> None:
        self.chunk_times.append(elapsed)
        self.chunk_tokens.append(num_tokens)

    @property
    def ttft(self) -> float | None:
        """Time to first token, or None when nothing arrived."""
        return self.chunk_times[0] if self.chunk_times else None

    def fail(self, error: str) -> None:
        self.success, self.error = False, error

    def to_json(self) -> dict[str, Any]:
        """Every number of the request (ids left out: they are workload data, not results)."""
        skip = ("prompt_ids", "output_ids")
        return {k: v for k, v in self.__dict__.items() if k not in skip} | {"ttft": self.ttft}


@dataclass
class BenchRun:
    """One system measured on one workload: its metrics and every request."""

    system: str
    backend: str
    metrics: dict[str, float]
    results: list[RequestResult]
    info: dict[str, Any] = field(default_factory=dict)
    """Where it ran: URL or engine arguments, the server's own info and stats."""

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "backend": self.backend,
            "metrics": self.metrics,
            "info": self.info,
            "requests": [r.to_json() for r in self.results],
        }
