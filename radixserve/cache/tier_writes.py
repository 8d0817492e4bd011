"""TierWriteGuard: what the hierarchical cache does when writing to its tier fails.

A write error (disk full, I/O error) while copying pages into the tier or saving its index
must neither leak pool pages nor fail the step: the write is given up (its slots freed, the
node stays pool-only or is dropped as if the tier were full), and no tier write is tried
again for a back-off that doubles with each failure in a row. Meanwhile the cache serves from
the pool and still loads back what the tier already holds; its stats say so (/health,
/metrics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0  # the first failure's pause
BACKOFF_MAX_S = 300.0  # the longest pause, however many failures came in a row


@dataclass
class TierWriteGuard:
    """Counts tier write failures and holds writes off after each (see module doc)."""

    num_errors: int = 0
    last_error: str = ""
    backoff_s: float = 0.0  # the current pause; 0 after a write succeeds
    retry_at: float = 0.0  # monotonic time before which no write is tried
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def allows_write(self) -> bool:
        """False while backing off after a failure."""
        return self.clock() >= self.retry_at

    def attempt(self, what: str, write: Callable[..., Any], *args: Any) -> bool:
        """Runs `write(*args)`; an OSError is counted, logged and starts a back-off, and
        False is returned instead of raising."""
        try:
            write(*args)
        except OSError as exc:
            self._failed(what, exc)
            return False
        self.backoff_s = 0.0
        return True

    def _failed(self, what: str, exc: OSError) -> None:
        self.num_errors += 1
        self.last_error = f"{what}: {exc}"
        self.backoff_s = min(max(2 * self.backoff_s, BACKOFF_MIN_S), BACKOFF_MAX_S)
        self.retry_at = self.clock() + self.backoff_s
        logger.warning(
            "hicache: %s failed (%s); no tier writes for %.0f s, serving from the pool",
            what,
            exc,
            self.backoff_s,
        )

    def stats(self) -> dict[str, Any]:
        """`hicache_write_errors` (a counter), `hicache_write_backoff_s` (seconds left; 0:
        writing) and the last error's text."""
        return {
            "hicache_write_errors": self.num_errors,
            "hicache_write_backoff_s": max(0.0, self.retry_at - self.clock()),
            "hicache_last_write_error": self.last_error,
        }
