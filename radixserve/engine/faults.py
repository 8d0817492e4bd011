"""Fault injection for the fault tests and the soak script; off unless RADIXSERVE_FAULTS is set.

    RADIXSERVE_FAULTS='{"rid_prefix": "fault-", "points": ["commit", "forward"]}'
    RADIXSERVE_FAULTS='[{"rid_prefix": "c-", "points": ["commit"]}, {"rid_prefix": "f-", ...}]'

A request whose rid starts with a rule's `rid_prefix` makes the rule's points raise
`InjectedFault`:
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
    rules: tuple[tuple[str, frozenset[str]], ...]  # (rid prefix, points)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return None
        config = json.loads(raw)
        return cls(tuple(_rule(r) for r in (config if isinstance(config, list) else [config])))

    def check(self, point: str, rids: Iterable[str]) -> None:
        """Raises InjectedFault if one of `rids` is marked by a rule that arms `point`."""
        prefixes = tuple(prefix for prefix, points in self.rules if point in points)
        if prefixes and any(rid.startswith(prefixes) for rid in rids):
            raise InjectedFault(f"injected {point} fault")


def _rule(config: dict) -> tuple[str, frozenset[str]]:
    points = frozenset(config.get("points", POINTS))
    unknown = points - set(POINTS)
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown points {sorted(unknown)}; known: {POINTS}")
    return str(config["rid_prefix"]), points
