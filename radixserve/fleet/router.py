"""sglang-router as a child process: the check that it is installed, and its command line."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from radixserve.fleet import router_main

ROUTER_LAUNCHER = str(Path(router_main.__file__).resolve())
"""sglang-router's launcher, its key read from the environment (ROUTER_API_KEY_ENV)."""
ROUTER_LOG_LEVELS = {"warning": "warn"}
"""Our --log-level names where the router's differ (it takes debug | info | warn | error)."""
INSTALL_HINT = "pip install 'radixserve[fleet]' (or: pip install sglang-router)"


class RouterNotInstalledError(RuntimeError):
    """sglang-router is an optional extra; the fleet cannot run without it."""


def require_router() -> None:
    """Raises RouterNotInstalledError, saying how to install it, unless sglang-router imports."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterNotInstalledError(f"radixserve fleet needs sglang-router: {INSTALL_HINT}")


@dataclass(frozen=True)
class PDWorkers:
    """The workers of a PD fleet: prefill ones with their bootstrap ports, decode ones."""

    prefill: list[tuple[str, int]]  # (url, bootstrap port)
    decode: list[str]


def worker_flags(workers: list[str] | PDWorkers) -> list[str]:
    """The router's worker list: `--worker-urls ...` (none: they register later), or in PD
    mode `--pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...`."""
    if not isinstance(workers, PDWorkers):
        return ["--worker-urls", *workers] if workers else []
    flags = ["--pd-disaggregation"]
    for url, bootstrap_port in workers.prefill:
        flags += ["--prefill", url, str(bootstrap_port)]
    for url in workers.decode:
        flags += ["--decode", url]
    return flags


def router_command(
    workers: list[str] | PDWorkers,
    host: str,
    port: int,
    policy: str,
    log_level: str | None = None,
    extra_args: str = "",
    prometheus_port: int | None = None,
) -> list[str]:
    """sglang-router's launcher in this interpreter, fronting `workers` (urls, or a PD
    fleet's); `extra_args` come last, so they override. Its key travels in the environment
    (ROUTER_API_KEY_ENV), never on this command line. `prometheus_port`: its metrics port
    (None: the router's default, 29000)."""
    command = [sys.executable, ROUTER_LAUNCHER, "--host", host, "--port", str(port)]
    command += ["--prometheus-host", host]  # its metrics port binds 0.0.0.0 by default
    if prometheus_port is not None:
        command += ["--prometheus-port", str(prometheus_port)]
    command += [*worker_flags(workers), "--policy", policy]
    if log_level:
        command += ["--log-level", ROUTER_LOG_LEVELS.get(log_level, log_level)]
    return command + shlex.split(extra_args)
