"""Where radixserve keeps what it builds once per machine (converted models, C++ extensions)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive flock on `lock_path` (created if absent) for the block: one process
    at a time; the kernel releases it when its holder dies, so it is never left stale."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
