"""Where radixserve keeps what it builds once per machine (converted models, C++ extensions)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"
