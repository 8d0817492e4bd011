"""SGLang's prefill/decode pairing fields on a request (sglang-router writes them in PD
mode): which exist, and their check into one `Bootstrap` per prompt."""

from __future__ import annotations

from typing import Any

from radixserve.engine.protocol import Bootstrap
from radixserve.sampling.params import is_int

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
"""SGLang's prefill/decode pairing fields, written by sglang-router in PD mode."""
ROOM_MASK = (1 << 64) - 1


def bootstraps(
    values: dict[str, Any], count: int, mode: str | None, per_prompt
) -> list[Bootstrap | None]:
    """Each prompt's bootstrap (host, port, room) from `values` (field -> value or a list per
    prompt, split by `per_prompt`), checked; all None when none is given. `mode`: the
    worker's --disaggregation-mode (None: the fields are refused)."""
    given = [name for name in BOOTSTRAP_FIELDS if values[name] is not None]
    if not given:
        return [None] * count
    if mode is None:
        raise ValueError(
            f"{given[0]} needs a worker started with --disaggregation-mode prefill or decode"
        )
    missing = [name for name in BOOTSTRAP_FIELDS if name not in given]
    if missing:
        raise ValueError(f"{missing[0]} is missing: {', '.join(BOOTSTRAP_FIELDS)} go together")
    hosts, ports, rooms = (per_prompt(values[n], count, n) for n in BOOTSTRAP_FIELDS)
    return [_bootstrap(*parts) for parts in zip(hosts, ports, rooms)]


def _bootstrap(host: Any, port: Any, room: Any) -> Bootstrap:
    if not isinstance(host, str) or not host:
        raise ValueError(f"bootstrap_host must be a non-empty string; got {host!r}")
    if not is_int(port) or not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port must be an int in [1, 65535]; got {port!r}")
    if not is_int(room) or not 0 <= room <= ROOM_MASK:
        raise ValueError(f"bootstrap_room must be an int in [0, 2**64); got {room!r}")
    return Bootstrap(host=host, port=port, room=room)
