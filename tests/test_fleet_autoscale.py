"""The fleet's autoscaler: flags that do not go together, the fleet port, slot moves, and a
real fleet behind sglang-router growing from 1 to 2 workers under a burst and back to 1 when
idle, every request answered 200. The policy itself: test_fleet_autoscale_policy.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
import urllib.error
import urllib.request

import pytest
from native_http import post
from test_fleet_router import FleetProcess

from conftest import prompt_ids
from radixserve.cli import main
from radixserve.config import FleetConfig
from radixserve.fleet.autoscale import Decision
from radixserve.fleet.autoscale_fleet import Autoscaler, FleetState, WorkerSlot
from radixserve.fleet.fleet_view import FleetView
from radixserve.fleet.launch import Child, stop_all
from radixserve_bench.systems import free_port_run

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'radixserve[fleet]')",
)


# ---- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"workers": 2, "min_workers": 1, "max_workers": 2}, "--workers"),
        ({"min_workers": 3, "max_workers": 2}, "--min-workers"),
        ({"max_workers": 2}, "--min-workers"),
        ({"prefill_workers": 1, "decode_workers": 1, "max_workers": 2}, "--prefill-workers"),
        ({"min_workers": 1, "max_workers": 2, "scale_interval_s": 0}, "--scale-interval-s"),
        ({"min_workers": 1, "max_workers": 2, "scale_cooldown_s": -1}, "--scale-cooldown-s"),
        ({"min_workers": 1, "max_workers": 2, "scale_up_ttft_target_s": -1}, "--scale-up-ttft"),
        (
            {"min_workers": 1, "max_workers": 2, "scale_up_ttft_slow_fraction": 0},
            "--scale-up-ttft-slow-fraction",
        ),
        ({"workers": 2, "fleet_port": 9}, "--fleet-port"),
    ],
)
def test_bad_autoscale_flags_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        FleetConfig(**kwargs)


def test_fleet_refuses_workers_with_min_max_at_start(tiny_chat_model):
    argv = ["fleet", tiny_chat_model, "--workers", "2", "--min-workers", "1", "--max-workers", "2"]
    with pytest.raises(SystemExit, match="--workers .* --min-workers / --max-workers"):
        main(argv)


def test_autoscaled_fleet_sizes_by_max_workers():
    assert FleetConfig(min_workers=1, max_workers=3).num_workers == 3
    assert FleetConfig().num_workers == 2 and FleetConfig(workers=5).num_workers == 5


# ---- the fleet port --------------------------------------------------------------------------


def http(url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_fleet_port_serves_metrics_stats_and_page_keyed():
    children = [Child(f"worker {i}", ["true"], f"http://127.0.0.1:{i + 1}") for i in range(2)]
    state = FleetState(children, desired=1)
    state.slots[0].state = "serving"
    view = FleetView.start(state, "127.0.0.1", 0, key="fleet-key-1")
    base = f"http://127.0.0.1:{view.port}"
    try:
        assert http(base + "/metrics")[0] == 401
        status, error = http(base + "/fleet/stats", key="wrong")
        assert status == 401 and "--api-key" in json.loads(error)["error"]["message"]
        status, text = http(base + "/metrics", key="fleet-key-1")
        assert status == 200
        assert b'radixserve_fleet:workers{state="serving"} 1.0' in text
        assert b"radixserve_fleet:desired_workers 1.0" in text
        status, body = http(base + "/fleet/stats", key="fleet-key-1")
        stats = json.loads(body)
        assert [w["state"] for w in stats["workers"]] == ["serving", "stopped"]
        status, page = http(base + "/")
        assert (
            status == 200 and b"/fleet/stats" in page and b"http" not in page.split(b"<script")[0]
        )
        assert http(base + "/nope", key="fleet-key-1")[0] == 404
    finally:
        view.stop()


def test_autoscaler_moves_slots_and_acts_on_decisions():
    """Slots of plain processes (nothing listens at their urls): up starts the first stopped
    one, down sends SIGTERM, an exit ends in stopped, a drain past its time is killed."""
    config = FleetConfig(min_workers=1, max_workers=2)
    children = [Child(f"w{i}", ["sleep", "30"], "http://127.0.0.1:9") for i in range(2)]
    state = FleetState(children, desired=1)
    router = Child("router", ["true"], "http://127.0.0.1:9")
    autoscaler = Autoscaler(config, state, router, stop_timeout_s=5)
    try:
        autoscaler.act(Decision(0, "up", 2, "test"), now=0)
        assert [s.state for s in state.slots] == ["starting", "stopped"]
        state.slots[0].state = "serving"  # as if its /health had answered
        autoscaler.act(Decision(1, "down", 1, "test", worker="w0"), now=1)
        assert state.slots[0].state == "draining"
        state.slots[0].child.proc.wait(10)  # sleep ends on SIGTERM
        autoscaler.refresh(now=2)
        assert state.slots[0].state == "stopped"
        stubborn = Child("w1", ["sh", "-c", "trap '' TERM; sleep 30"], "http://127.0.0.1:9")
        state.slots[1] = WorkerSlot(stubborn)
        autoscaler.act(Decision(3, "up", 2, "test"), now=3)  # w0 again: the first stopped
        state.slots[1].child.start()
        state.slots[1].move("draining", 3)
        autoscaler.refresh(now=9)  # past stop_timeout_s: killed
        assert state.slots[1].child.proc.wait(10) == -9
    finally:
        stop_all(children + [state.slots[1].child], timeout_s=5)


# ---- a real fleet behind sglang-router -----------------------------------------------------

SCALE_FLAGS = ["--scale-up-queue-per-worker", "1000", "--scale-down-idle-s", "2"]
SCALE_FLAGS += ["--scale-up-ttft-target-s", "0.01", "--scale-up-ttft-slow-fraction", "0.5"]
SCALE_FLAGS += ["--scale-interval-s", "0.5", "--scale-cooldown-s", "1"]
BURST = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
GROW_TIMEOUT_S = 300.0
"""A worker's start took 77 s measured on the 2 shared cores at load average 15 (7 s idle)."""
SHRINK_TIMEOUT_S = 60.0


class AutoscaledFleet(FleetProcess):
    """`radixserve fleet --min-workers 1 --max-workers 2` in a subprocess, one request running
    per worker so that a burst queues; scaled up on the TTFT signal alone (a queue threshold
    no burst reaches; the queue rule: test_fleet_autoscale_policy.py); `stats()` reads its
    fleet port."""

    def __init__(self, model: str):
        router_port, base, fleet_port, prom = (free_port_run(n) for n in (1, 2, 1, 1))
        self.url = f"http://127.0.0.1:{router_port}"
        self.fleet_url = f"http://127.0.0.1:{fleet_port}"
        command = [sys.executable, "-m", "radixserve.cli", "fleet", model, *SCALE_FLAGS]
        command += ["--min-workers", "1", "--max-workers", "2", "--policy", "round_robin"]
        command += ["--router-port", str(router_port), "--worker-base-port", str(base)]
        command += ["--fleet-port", str(fleet_port), "--max-total-tokens", "8192"]
        command += ["--max-running-requests", "1", "--router-args", f"--prometheus-port {prom}"]
        self._launch(command)

    def stats(self) -> dict:
        return json.loads(http(self.fleet_url + "/fleet/stats")[1])


async def burst_until(fleet: AutoscaledFleet, done, concurrency: int = 4) -> list[int]:
    """Closed-loop requests through the router until `done()`; their statuses."""
    statuses: list[int] = []

    async def client(i: int) -> None:
        while not done():
            body = {"input_ids": prompt_ids(i, length=6), "sampling_params": BURST}
            statuses.append((await post(fleet.url + "/generate", body))[0])

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return statuses


def serving(stats: dict) -> int:
    return stats["num_workers"]["serving"]


def shrunk(stats: dict) -> bool:
    """One worker serving, none starting or draining."""
    n = stats["num_workers"]
    return (n["serving"], n["starting"], n["draining"]) == (1, 0, 0)


@needs_router
def test_autoscaler_grows_under_a_burst_and_shrinks_when_idle(tiny_chat_model):
    fleet = AutoscaledFleet(tiny_chat_model)
    try:
        assert serving(fleet.stats()) == 1
        deadline = time.monotonic() + GROW_TIMEOUT_S
        grown = lambda: serving(fleet.stats()) == 2 or time.monotonic() > deadline  # noqa: E731
        statuses = asyncio.run(burst_until(fleet, grown))
        assert serving(fleet.stats()) == 2, "".join(fleet.log[-20:])
        more = time.monotonic() + 3  # traffic on both workers for a moment
        statuses += asyncio.run(burst_until(fleet, lambda: time.monotonic() > more))
        deadline = time.monotonic() + SHRINK_TIMEOUT_S
        while not shrunk(stats := fleet.stats()):
            assert time.monotonic() < deadline, stats
            time.sleep(0.5)
        assert statuses and set(statuses) == {200}
        rules = [(d["action"], d["rule"]) for d in stats["decisions"]]
        scaled = "".join(line for line in fleet.log if "fleet: scale" in line)
        assert rules == [("up", "ttft"), ("down", "idle")], scaled
        metrics = http(fleet.fleet_url + "/metrics")[1].decode()
        assert 'radixserve_fleet:scaling_decisions_total{action="up",rule="ttft"} 1.0' in metrics
        assert 'scaling_decisions_total{action="up",rule="queue"} 0.0' in metrics
        assert "scale up to 2 workers [ttft]" in "".join(fleet.log)
    finally:
        assert fleet.stop() == 0, "".join(fleet.log[-30:])
