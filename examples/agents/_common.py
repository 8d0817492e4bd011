"""What every agent example shares: its flags, the backend it runs on, and the cache report.

Each example runs the default model in-process (`radixserve.Engine`) unless given
`--url URL`, a running `radixserve serve`; either way it becomes the default backend, so the
programs themselves never name one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import radixserve as sgl
from radixserve.frontend_lang import Backend, ProgramState

MAX_TOTAL_TOKENS = 8192
"""KV cache size of the in-process engine: room for every example's whole batch."""


def parse_args(
    doc: str | None, max_tokens: int, num: int | None = None, num_help: str = ""
) -> argparse.Namespace:
    """--url, --max-tokens (a cap on each gen) and, where the example has one, --num."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running `radixserve serve` (default: in-process model)")
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"per gen (default: {max_tokens})"
    )
    if num is not None:
        parser.add_argument("--num", type=int, default=num, help=f"{num_help} (default: {num})")
    args = parser.parse_args()
    if args.max_tokens < 1 or getattr(args, "num", 1) < 1:
        parser.error("--max-tokens and --num must be >= 1")
    return args


@contextmanager
def open_backend(url: str | None) -> Iterator[Backend]:
    """The server at `url`, or the default model in-process; set as the default backend."""
    if url is not None:
        backend = sgl.RuntimeEndpoint(url)
        sgl.set_default_backend(backend)
        print(f"backend: {url} ({backend.model_info.get('model_path')})")
        yield backend
        return
    with sgl.Engine(max_total_tokens=MAX_TOTAL_TOKENS) as engine:
        backend = sgl.EngineBackend(engine)
        sgl.set_default_backend(backend)
        print(f"backend: in-process {engine.model_name}")
        yield backend


@dataclass(frozen=True)
class CacheReport:
    """Engine counters over one stretch of work (a server's counters include other clients)."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __str__(self) -> str:
        return (
            f"engine: {self.num_requests} requests, {self.cached_tokens}/{self.prompt_tokens} "
            f"prompt tokens from the radix cache (hit rate {self.hit_rate:.0%}), "
            f"{self.seconds:.1f} s"
        )


class CacheMeter:
    """Counts what the engine did from construction to `report()`."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.before = _stats(backend)
        self.start = time.perf_counter()

    def report(self) -> CacheReport:
        after = _stats(self.backend)
        fields = ("num_requests", "prompt_tokens", "cached_tokens")
        delta = {k: after[k] - self.before[k] for k in fields}
        return CacheReport(**delta, seconds=time.perf_counter() - self.start)


def _stats(backend: Backend) -> dict[str, Any]:
    return sgl.get_server_info(backend)["stats"]


def cached(state: ProgramState, name: str) -> str:
    """`cached/prompt` tokens of gen `name`, from the meta info the backend reported."""
    meta = state.get_meta_info(name) or {}
    return f"{meta.get('cached_tokens', 0)}/{meta.get('prompt_tokens', 0)}"
