"""sglang-router as a child process: the check that it is installed, and its command line."""

from __future__ import annotations

import importlib.util
import shlex
import sys

ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_LOG_LEVELS = {"warning": "warn"}
"""Our --log-level names where the router's differ (it takes debug | info | warn | error)."""
INSTALL_HINT = "pip install 'radixserve[fleet]' (or: pip install sglang-router)"


class RouterNotInstalledError(RuntimeError):
    """sglang-router is an optional extra; the fleet cannot run without it."""


def require_router() -> None:
    """Raises RouterNotInstalledError, saying how to install it, unless sglang-router imports."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterNotInstalledError(f"radixserve fleet needs sglang-router: {INSTALL_HINT}")


def router_command(
    worker_urls: list[str],
    host: str,
    port: int,
    policy: str,
    api_key: str | None = None,
    log_level: str | None = None,
    extra_args: str = "",
) -> list[str]:
    """`python -m sglang_router.launch_router ...` in this interpreter, fronting `worker_urls`;
    `extra_args` come last, so they override."""
    command = [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port)]
    command += ["--worker-urls", *worker_urls, "--policy", policy]
    if api_key:
        command += ["--api-key", api_key]
    if log_level:
        command += ["--log-level", ROUTER_LOG_LEVELS.get(log_level, log_level)]
    return command + shlex.split(extra_args)
