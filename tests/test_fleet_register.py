"""Workers that join a real sglang-router by themselves (`serve --router-url`), survive its
restart, and leave it on SIGTERM without failing a request (graceful drain)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from native_http import post, run

from conftest import ServerProcess, prompt_ids
from radixserve.config import ServerConfig
from radixserve.fleet.register import WorkerRegistration
from radixserve.fleet.router import router_command
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV
from radixserve.server.anthropic_api import anthropic_error_middleware
from radixserve.server.app import error_middleware
from radixserve.server.drain import Drain
from radixserve_bench.systems import free_port_run

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'radixserve[fleet]')",
)
KEY = "register-key-81c2"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
JOIN_TIMEOUT_S = 60.0
LOAD = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


class Router:
    """sglang-router on 127.0.0.1 with the key KEY and no workers of its own."""

    def __init__(self):
        self.port = free_port_run(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        extra = f"--prometheus-port {free_port_run(1)}"
        command = router_command([], "127.0.0.1", self.port, "round_robin", "warning", extra)
        env = os.environ | {ROUTER_API_KEY_ENV: KEY}
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)

    def restart(self) -> None:
        """A new router on the same port, knowing no worker."""
        self.stop()
        self.proc = self._start()

    def worker_urls(self) -> list[str] | None:
        """The urls GET /workers lists, or None while the router does not answer."""
        request = urllib.request.Request(self.url + "/workers", headers=AUTH)
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return sorted(w["url"] for w in json.loads(response.read())["workers"])
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_for_workers(self, urls: list[str], timeout_s: float = JOIN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.worker_urls() != sorted(urls):
            assert self.proc.poll() is None, "the router exited"
            assert time.monotonic() < deadline, f"router lists {self.worker_urls()}, not {urls}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()  # its SIGTERM waits out a grace period; nothing of ours runs there
        self.proc.wait(30)


@pytest.fixture(scope="module")
def fleet(tiny_chat_model):
    """A router and two workers that registered themselves with it."""
    router = Router()
    env = {"RADIXSERVE_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    flags = ("--router-url", router.url, "--log-level", "info")
    workers = [ServerProcess(tiny_chat_model, *flags, wait=False, env=env) for _ in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        yield router, workers
    finally:
        for worker in workers:
            worker.stop()
        router.stop()


@needs_router
def test_workers_join_and_rejoin_a_restarted_router(fleet):
    router, workers = fleet
    router.wait_for_workers([w.url for w in workers])
    status, out = run(post(router.url + "/generate", _body(), headers=AUTH))
    assert status == 200 and len(out["output_ids"]) == LOAD["max_new_tokens"]
    router.restart()  # the new one knows no worker: they register again by themselves
    router.wait_for_workers([w.url for w in workers])
    for worker in workers:
        assert sum("joined the router" in line for line in worker.log) == 2, worker.log[-20:]


@needs_router
def test_the_router_reads_each_workers_load(fleet):
    """sglang-router polls each worker's /get_load (its power_of_two policy's input): a
    worker running a long request reports its KV tokens, an idle one none."""
    router, workers = fleet
    router.wait_for_workers([w.url for w in workers])
    body = {"input_ids": prompt_ids(7, 64), "sampling_params": LOAD | {"max_new_tokens": 400}}
    busy = threading.Thread(target=lambda: run(post(workers[0].url + "/generate", body,
                                                    headers=AUTH)))  # fmt: skip
    busy.start()
    try:
        loads = {}
        deadline = time.monotonic() + 30
        while not loads.get(workers[0].url) and time.monotonic() < deadline:
            request = urllib.request.Request(router.url + "/get_loads", headers=AUTH)
            with urllib.request.urlopen(request, timeout=5) as response:
                loads = {w["worker"]: w["load"] for w in json.loads(response.read())["workers"]}
            time.sleep(0.1)
        assert loads[workers[0].url] >= 64 and loads[workers[1].url] == 0, loads
    finally:
        busy.join(60)
    request = urllib.request.Request(workers[1].url + "/get_load", headers=AUTH)
    with urllib.request.urlopen(request, timeout=5) as response:
        [load] = json.loads(response.read())
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0


@needs_router
def test_sigterm_under_load_loses_no_request(fleet):
    router, workers = fleet
    router.wait_for_workers([w.url for w in workers])
    statuses: Counter = Counter()
    stop = threading.Event()
    clients = [threading.Thread(target=_load, args=(router.url, stop, statuses)) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        _wait_for(lambda: sum(statuses.values()) >= 8)
        leaving = workers[1]
        assert leaving.stop(timeout=60) == 0  # SIGTERM: leave the router, drain, exit 0
        served = sum(statuses.values())
        _wait_for(lambda: sum(statuses.values()) >= served + 8)  # the other one serves on
    finally:
        stop.set()
        for client in clients:
            client.join(60)
    assert set(statuses) == {200}, statuses
    assert router.worker_urls() == [workers[0].url]
    log = "".join(leaving.log)
    assert "left the router" in log, log[-2000:]


def _body() -> dict:
    return {"input_ids": prompt_ids(5), "sampling_params": LOAD}


def _load(url: str, stop: threading.Event, statuses: Counter) -> None:
    """Sends /generate through the router back to back until `stop`, counting statuses."""
    data = json.dumps(_body()).encode()
    while not stop.is_set():
        request = urllib.request.Request(url + "/generate", data, AUTH, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                statuses[response.status] += 1
        except urllib.error.HTTPError as exc:
            statuses[exc.code] += 1
        except (urllib.error.URLError, OSError) as exc:
            statuses[type(exc).__name__] += 1


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# ---- the drain itself, without a model ---------------------------------------------------


class FakeClient:
    """What Drain.run reads of an EngineClient: one request that never finishes by itself."""

    def __init__(self):
        self.ids = ["r1"]
        self.dead = False

    @property
    def num_active(self) -> int:
        return len(self.ids)

    def active_request_ids(self) -> list[str]:
        return list(self.ids)

    def abort(self, ids: list[str]) -> None:
        self.ids = [i for i in self.ids if i not in ids]


def test_a_draining_server_leaves_first_then_answers_503_in_each_apis_shape():
    drain, client, events = Drain(), FakeClient(), []

    async def ok(request):
        return web.json_response({"ok": True})

    async def leave():
        events.append(("left", drain.draining))

    async def scenario():
        app = web.Application(
            middlewares=[anthropic_error_middleware, drain.middleware, error_middleware]
        )
        for path in ("/generate", "/v1/chat/completions", "/v1/messages", "/health", "/metrics"):
            app.router.add_route("*", path, ok)
        async with TestClient(TestServer(app)) as http:
            assert (await http.post("/generate")).status == 200
            await drain.run(client, timeout_s=0.2, leave_router=leave)
            answers = {}
            for path in ("/generate", "/v1/chat/completions", "/v1/messages", "/health"):
                response = await http.post(path) if path != "/health" else await http.get(path)
                answers[path] = (response.status, await response.json())
            metrics = (await http.get("/metrics")).status
        return answers, metrics

    answers, metrics = asyncio.run(scenario())
    assert events == [("left", False)]  # the router first, while still serving
    assert client.ids == []  # the request past --drain-timeout was aborted
    for path in ("/generate", "/v1/chat/completions", "/health"):
        status, body = answers[path]
        assert status == 503 and body["error"]["code"] == 503, (path, body)
    status, body = answers["/v1/messages"]
    assert status == 503 and body["type"] == "error" and body["error"]["type"] != "api_error"
    assert metrics == 200


def test_registration_names_the_workers_type_bootstrap_port_and_key(monkeypatch):
    monkeypatch.delenv(ROUTER_API_KEY_ENV, raising=False)
    config = ServerConfig(port=31001, api_key="k", router_url="http://r:1/")
    plain = WorkerRegistration.from_config(config, None, 8998)
    assert plain.body() == {
        "url": "http://127.0.0.1:31001",
        "worker_type": "regular",
        "api_key": "k",
    }
    assert plain.router_url == "http://r:1" and plain.router_key == "k"
    prefill = WorkerRegistration.from_config(config, "prefill", 8998)
    assert prefill.body()["worker_type"] == "prefill" and prefill.body()["bootstrap_port"] == 8998
    assert "bootstrap_port" not in WorkerRegistration.from_config(config, "decode", 8998).body()
    with pytest.raises(ValueError, match="--disaggregation-bootstrap-port must be a fixed port"):
        WorkerRegistration.from_config(config, "prefill", 0)
    monkeypatch.setenv(ROUTER_API_KEY_ENV, "router-key")
    advertised = ServerConfig(router_url="http://r:1", advertise_url="http://w:2")
    registration = WorkerRegistration.from_config(advertised, None, 8998)
    assert registration.url == "http://w:2" and registration.router_key == "router-key"
    assert "api_key" not in registration.body()
    with pytest.raises(ValueError, match="router_url"):
        ServerConfig(router_url="r:1").verify()
