"""HTTP probes of the fleet's processes: a worker's /health, the router's liveness and
readiness (how many workers it counts healthy)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def worker_healthy(url: str) -> bool:
    return http_get(url + "/health") is not None


def router_live(url: str) -> bool:
    """Whether the router answers at all (it does before any worker is added)."""
    return http_get(url + "/liveness") is not None


def router_ready(url: str, num_workers: int) -> bool:
    """Whether the router answers and counts every worker healthy (it adds them in the
    background after it starts listening)."""
    body = http_get(url + "/readiness")
    try:
        return json.loads(body)["healthy_workers"] >= num_workers
    except (TypeError, ValueError, KeyError):
        return False


def http_get(url: str) -> bytes | None:
    """The body of a 200 answer, or None."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None
