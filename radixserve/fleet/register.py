"""A worker that joins sglang-router by itself (`radixserve serve --router-url URL`).

    once healthy   POST {router}/workers {url, api_key, worker_type[, bootstrap_port]}
    every few s    GET  {router}/workers: our url missing (the router restarted) -> POST again;
                   router unreachable -> retry after 1, 2, 4, 8, then every 15 s
    SIGTERM        DELETE {router}/workers/{id}, then wait until the list no longer names us
                   (the router removes workers in the background), bounded by LEAVE_TIMEOUT_S

The router's admin routes take its --api-key: $RADIXSERVE_ROUTER_API_KEY, else this worker's
own key (a fleet shares one). The body's `api_key` is what the router sends this worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import aiohttp

from radixserve.config import ServerConfig
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 3.0
"""How often a registered worker checks that the router still lists it."""
FIRST_RETRY_S = 1.0
MAX_BACKOFF_S = 15.0
"""While the router is unreachable or refuses us: retries after 1, 2, 4, 8, then every 15 s."""
REQUEST_TIMEOUT_S = 5.0
LEAVE_TIMEOUT_S = 10.0
"""How long SIGTERM waits for the router to drop this worker before draining anyway."""
LEAVE_POLL_S = 0.2


class RouterError(RuntimeError):
    """The router refused a call or could not be reached."""


@dataclass(frozen=True)
class WorkerRegistration:
    """What this worker tells the router about itself."""

    router_url: str
    url: str  # where the router reaches this worker (--advertise-url)
    worker_key: str | None  # the router sends it to this worker
    router_key: str | None  # this worker sends it to the router's admin routes
    worker_type: str = "regular"  # regular | prefill | decode
    bootstrap_port: int | None = None  # a prefill worker's KV port

    @classmethod
    def from_config(
        cls, config: ServerConfig, disaggregation_mode: str | None, bootstrap_port: int
    ) -> WorkerRegistration:
        """From `serve`'s flags (--router-url must be set)."""
        if config.router_url is None:
            raise ValueError("router_url is not set")
        if disaggregation_mode == "prefill" and bootstrap_port == 0:
            raise ValueError(
                "--disaggregation-bootstrap-port must be a fixed port with --router-url (the "
                "router is told it); got 0"
            )
        url = config.advertise_url or f"http://{_url_host(config.host)}:{config.port}"
        return cls(
            router_url=config.router_url.rstrip("/"),
            url=url.rstrip("/"),
            worker_key=config.api_key,
            router_key=os.environ.get(ROUTER_API_KEY_ENV) or config.api_key,
            worker_type=disaggregation_mode or "regular",
            bootstrap_port=bootstrap_port if disaggregation_mode == "prefill" else None,
        )

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"url": self.url, "worker_type": self.worker_type}
        if self.worker_key is not None:
            body["api_key"] = self.worker_key
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class RouterClient:
    """sglang-router's worker API (0.3: POST / GET /workers, DELETE /workers/{id})."""

    def __init__(self, registration: WorkerRegistration):
        self.registration = registration
        headers = {"Content-Type": "application/json"}
        if registration.router_key is not None:
            headers["Authorization"] = f"Bearer {registration.router_key}"
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        self._session = aiohttp.ClientSession(headers=headers, timeout=timeout)

    async def add(self) -> None:
        await self._call("POST", "/workers", self.registration.body())

    async def worker_id(self) -> str | None:
        """The router's id for this worker's url, or None when it does not list it."""
        listing = await self._call("GET", "/workers")
        for worker in listing.get("workers", []) if isinstance(listing, dict) else []:
            if worker.get("url", "").rstrip("/") == self.registration.url:
                return str(worker["id"])
        return None

    async def remove(self, worker_id: str) -> None:
        await self._call("DELETE", f"/workers/{worker_id}")

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        url = self.registration.router_url + path
        try:
            async with self._session.request(method, url, json=body) as response:
                text = await response.text()
                if response.status >= 300:
                    raise RouterError(f"{method} {path}: HTTP {response.status} {text[:200]}")
                return await response.json(content_type=None) if text else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise RouterError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc


class RouterMembership:
    """Keeps this worker registered with the router until `leave`: `start` once the server
    answers, `leave` first thing on SIGTERM."""

    def __init__(self, registration: WorkerRegistration):
        self.registration = registration
        self.client: RouterClient | None = None
        self._task: asyncio.Task | None = None
        self.registered = False

    @property
    def _router(self) -> str:
        return self.registration.router_url

    def start(self) -> None:
        self.client = RouterClient(self.registration)
        self._task = asyncio.get_running_loop().create_task(self._keep_registered())

    async def leave(self) -> bool:
        """Stops re-registering, removes this worker and waits until the router no longer
        lists it (at most LEAVE_TIMEOUT_S); True once it is gone."""
        if self._task is None or self.client is None:
            return True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        try:
            return await asyncio.wait_for(self._remove(), LEAVE_TIMEOUT_S)
        except (RouterError, asyncio.TimeoutError) as exc:
            logger.warning("could not leave the router at %s: %s", self._router, exc)
            return False
        finally:
            await self.client.close()

    async def _remove(self) -> bool:
        removed: set[str] = set()  # the router removes in the background: ask once per id
        while (worker_id := await self.client.worker_id()) is not None:
            if worker_id not in removed:
                await self.client.remove(worker_id)
                removed.add(worker_id)
            await asyncio.sleep(LEAVE_POLL_S)
        logger.info("left the router at %s", self._router)
        return True

    async def _keep_registered(self) -> None:
        failures = 0
        while True:
            try:
                await self._check_once()
                failures, delay = 0, CHECK_INTERVAL_S
            except RouterError as exc:
                if failures == 0:  # once per outage
                    logger.warning("router %s: %s; retrying", self._router, exc)
                failures += 1
                self.registered = False
                delay = min(FIRST_RETRY_S * 2 ** (failures - 1), MAX_BACKOFF_S)
            await asyncio.sleep(delay)

    async def _check_once(self) -> None:
        if await self.client.worker_id() is not None:
            self.registered = True
            return
        if self.registered:
            logger.warning("router %s forgot this worker; registering again", self._router)
        self.registered = False
        await self.client.add()
        self.registered = True
        kind = self.registration.worker_type
        logger.info("%s joined the router at %s (%s)", self.registration.url, self._router, kind)
