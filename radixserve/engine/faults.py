"""Fault injection for the fault tests and the soak script; off unless RADIXSERVE_FAULTS is set.

    RADIXSERVE_FAULTS='{"rid_prefix": "fault-", "points": ["commit", "forward"]}'

A request whose rid starts with `rid_prefix` makes the named points raise `InjectedFault`:
  forward     the model forward of any step that includes it (the whole step fails)
  sample      the batched sampling of any step that samples it
  commit      committing its new token (only that request fails)
  detokenize  the caller's detokenizer of its output (server process or Engine)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV_VAR = "RADIXSERVE_FAULTS"
POINTS = ("forward", "sample", "commit", "detokenize")


class InjectedFault(RuntimeError):
    """Raised at an injection point."""


@dataclass(frozen=True)
class FaultInjector:
    rid_prefix: str
    points: frozenset[str]

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return None
        config = json.loads(raw)
        points = frozenset(config.get("points", POINTS))
        unknown = points - set(POINTS)
        if unknown:
            raise ValueError(f"{ENV_VAR}: unknown points {sorted(unknown)}; known: {POINTS}")
        return cls(rid_prefix=str(config["rid_prefix"]), points=points)

    def check(self, point: str, rids: Iterable[str]) -> None:
        """Raises InjectedFault if `point` is armed and one of `rids` is marked."""
        if point in self.points and any(rid.startswith(self.rid_prefix) for rid in rids):
            raise InjectedFault(f"injected {point} fault")
