"""The fleet's keys: the router's (--api-key, what clients send) and the workers' (that same
key, or one drawn for this run when the router has none), and how each process gets its own
without a command line, which `ps` shows to every user of the machine.

    router    $RADIXSERVE_ROUTER_API_KEY -> fleet/router_main.py -> sglang-router --api-key
              (it checks the clients' Bearer key and sends its own to the workers)
    workers   $RADIXSERVE_API_KEY (what `serve` reads: config/keys.py)
    data-parallel: each worker is registered through the router's POST /workers with its key,
              so a router without a key still opens the keyed workers
    PD:       sglang-router 0.3 forwards the client's Authorization to PD workers: they get
              the router's key, or none behind a keyless router (then loopback and
              server/request_guard.py are what guard them)
"""

from __future__ import annotations

import json
import logging
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass

from radixserve.config import API_KEY_ENV, ServerConfig
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV

logger = logging.getLogger(__name__)
REGISTER_TIMEOUT_S = 10.0
WORKER_KEY_BYTES = 32


@dataclass(frozen=True)
class FleetKeys:
    """The key clients give the router (None: open), and the one the router gives workers."""

    router: str | None
    workers: str | None

    def worker_env(self) -> dict[str, str]:
        return {} if self.workers is None else {API_KEY_ENV: self.workers}

    def router_env(self) -> dict[str, str]:
        return {} if self.router is None else {ROUTER_API_KEY_ENV: self.router}


def fleet_keys(server: ServerConfig, pd_disaggregation: bool) -> FleetKeys:
    """The router's key is --api-key; workers share it, or get a fresh one (data-parallel)."""
    if server.admin_api_key is not None:
        raise ValueError(
            "--admin-api-key is not a fleet flag: the router holds one key (--api-key) and "
            "opens every worker route with it"
        )
    if server.api_key is not None:
        return FleetKeys(server.api_key, server.api_key)
    drawn = None if pd_disaggregation else secrets.token_urlsafe(WORKER_KEY_BYTES)
    return FleetKeys(None, drawn)


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
