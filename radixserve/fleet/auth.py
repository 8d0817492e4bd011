"""The fleet's keys: the router's (--api-key, what clients send) and the workers' (that same
key, or one drawn for this run when the router has none), and how each process gets its own
without a command line, which `ps` shows to every user of the machine.

    router    $RADIXSERVE_ROUTER_API_KEY -> fleet/router_main.py -> sglang-router --api-key
              (it checks the clients' Bearer key and sends its own to the workers)
    workers   $RADIXSERVE_API_KEY (what `serve` reads: config/keys.py)
    data-parallel: each worker is registered through the router's POST /workers with its key,
              so a router without a key still opens the keyed workers
    PD:       sglang-router 0.3 forwards the client's Authorization to PD workers: they get
              the router's key; behind a keyless router no user key (its clients send none)
              but an admin key drawn for this run ($RADIXSERVE_ADMIN_API_KEY), so a worker's
              user routes are as open as the router's and no more: its admin routes and
              dashboard need a key only the fleet holds
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from radixserve.config import ADMIN_API_KEY_ENV, API_KEY_ENV, FleetConfig, ServerConfig
from radixserve.disagg.auth import write_secret_file
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV

logger = logging.getLogger(__name__)
REGISTER_TIMEOUT_S = 10.0
WORKER_KEY_BYTES = 32


@dataclass(frozen=True)
class FleetKeys:
    """The key clients give the router (None: open), the one the router gives workers, and
    the workers' admin key when it differs (a keyless PD fleet's, drawn for the run)."""

    router: str | None
    workers: str | None
    workers_admin: str | None = None

    def worker_env(self) -> dict[str, str]:
        env = {} if self.workers is None else {API_KEY_ENV: self.workers}
        if self.workers_admin is not None:
            env[ADMIN_API_KEY_ENV] = self.workers_admin
        return env

    def router_env(self) -> dict[str, str]:
        return {} if self.router is None else {ROUTER_API_KEY_ENV: self.router}


def fleet_keys(server: ServerConfig, pd_disaggregation: bool) -> FleetKeys:
    """The router's key is --api-key; workers share it, or get a fresh one (data-parallel),
    or a fresh admin key only (PD: the router forwards its clients' keyless requests)."""
    if server.admin_api_key is not None:
        raise ValueError(
            "--admin-api-key is not a fleet flag: the router holds one key (--api-key) and "
            "opens every worker route with it"
        )
    if server.api_key is not None:
        return FleetKeys(server.api_key, server.api_key)
    drawn = secrets.token_urlsafe(WORKER_KEY_BYTES)
    return FleetKeys(None, None, drawn) if pd_disaggregation else FleetKeys(None, drawn)


def register_workers(router_url: str, worker_urls: list[str], keys: FleetKeys) -> bool:
    """Adds each worker, with its key, through the router's POST /workers; False (logged)
    when the router refuses one."""
    headers = {"Content-Type": "application/json"}
    if keys.router is not None:
        headers["Authorization"] = f"Bearer {keys.router}"
    for url in worker_urls:
        body = json.dumps({"url": url, "api_key": keys.workers}).encode()
        request = urllib.request.Request(router_url + "/workers", body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=REGISTER_TIMEOUT_S):
                pass
        except (urllib.error.URLError, OSError) as exc:
            logger.error("the router did not register worker %s: %s", url, exc)
            return False
    return True


@contextmanager
def pd_secret_file(config: FleetConfig, engine_args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A PD fleet's engine arguments with the secret its KV transfers share: the given
    --disaggregation-secret-file, or a fresh one (mode 0600) in a new 0700 run directory
    (under $XDG_RUNTIME_DIR if set, else the system's temp folder; never the cwd), removed
    with it when the fleet exits."""
    if not config.pd_disaggregation or engine_args.get("disaggregation_secret_file"):
        yield engine_args
        return
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = tempfile.mkdtemp(
        prefix="radixserve-fleet-", dir=runtime if runtime and os.path.isdir(runtime) else None
    )
    try:
        path = os.path.join(folder, "disaggregation-secret")
        write_secret_file(path)
        yield engine_args | {"disaggregation_secret_file": path}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
