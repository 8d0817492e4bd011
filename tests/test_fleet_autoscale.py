"""The fleet's autoscaler: its policy on synthetic samples, the metric reading, the fleet port,
flags that do not go together, and a real fleet behind sglang-router growing from 1 to 2
workers under a burst and back to 1 when idle, every request answered 200."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_server_native import post

from conftest import prompt_ids
from radixserve.cli import main
from radixserve.config import FleetConfig
from radixserve.fleet.autoscale import (
    UP_SAMPLES,
    Decision,
    FleetSample,
    ScalingPolicy,
    WorkerSample,
)
from radixserve.fleet.autoscale_fleet import Autoscaler, FleetState, WorkerSlot
from radixserve.fleet.autoscale_scrape import TTFTWindow, histogram_quantile, parse_worker_metrics
from radixserve.fleet.fleet_view import FleetView
from radixserve.fleet.launch import Child, stop_all
from radixserve.server.metrics import ServerMetrics
from radixserve_bench.systems import free_port_run

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'radixserve[fleet]')",
)


def policy(**overrides) -> ScalingPolicy:
    args = dict(min_workers=1, max_workers=3, queue_per_worker=2, idle_s=10, cooldown_s=5)
    return ScalingPolicy(**(args | overrides))


def sample(t: float, *queues: tuple[float, float], starting: int = 0) -> FleetSample:
    """Workers w0, w1, ... with (waiting, running) each."""
    workers = tuple(WorkerSample(f"w{i}", w, r) for i, (w, r) in enumerate(queues))
    return FleetSample(t, workers, starting)


# ---- the policy ------------------------------------------------------------------------------


def test_a_queue_two_scrapes_long_adds_one_worker_then_cools_down():
    p = policy()
    assert p.decide(sample(0, (4, 1))).action == "hold"  # one scrape: a blip
    up = p.decide(sample(1, (4, 1)))
    assert (up.action, up.desired) == ("up", 2) and "--scale-up-queue-per-worker" in up.reason
    assert p.decide(sample(2, (6, 1), starting=1)).action == "hold"  # still starting
    assert p.decide(sample(3, (6, 1), (6, 1))).reason == "cool-down"
    assert p.decide(sample(6, (6, 1), (6, 1))).action == "up"  # 2 scrapes high since the up
    assert p.decide(sample(12, (6, 1), (6, 1), (6, 1))).action == "hold"  # at --max-workers


def test_below_min_workers_starts_one_at_once():
    p = policy(min_workers=2)
    d = p.decide(sample(0, (0, 0)))
    assert (d.action, d.desired, d.reason) == ("up", 2, "below --min-workers")


def test_a_worker_idle_for_scale_down_idle_s_is_drained_not_below_min():
    p = policy(cooldown_s=0)
    assert p.decide(sample(0, (0, 1), (0, 0))).action == "hold"
    assert p.decide(sample(9, (0, 1), (0, 0))).action == "hold"  # w1 idle 9 s < 10
    down = p.decide(sample(10, (0, 1), (0, 0)))
    assert (down.action, down.worker, down.desired) == ("down", "w1", 1)
    assert p.decide(sample(30, (0, 0))).action == "hold"  # --min-workers 1


def test_work_resets_the_idle_clock_and_ties_drain_the_newest():
    p = policy(cooldown_s=0)
    p.decide(sample(0, (0, 0), (0, 0)))
    p.decide(sample(5, (0, 0), (0, 1)))  # w1 busy again
    down = p.decide(sample(12, (0, 0), (0, 0)))
    assert down.worker == "w0"  # idle since 0; w1 only since 12
    p = policy(cooldown_s=0)
    p.decide(sample(0, (0, 0), (0, 0)))
    assert p.decide(sample(10, (0, 0), (0, 0))).worker == "w1"


def test_no_drain_while_the_queue_is_high():
    p = policy(cooldown_s=0, max_workers=2)
    p.decide(sample(0, (5, 1), (0, 0)))
    assert p.decide(sample(20, (5, 1), (0, 0))).action == "hold"  # w1 idle, but w0 queues


def test_an_oscillating_load_does_not_flap():
    """Load that alternates every scrape between a queue and none never scales."""
    p = policy(cooldown_s=0)
    actions = {p.decide(sample(t, (4 * (t % 2), 1))).action for t in range(40)}
    assert actions == {"hold"}
    assert UP_SAMPLES >= 2


def test_policy_from_config_takes_the_flags():
    config = FleetConfig(min_workers=1, max_workers=4, scale_up_queue_per_worker=3)
    p = ScalingPolicy.from_config(config)
    assert (p.min_workers, p.max_workers, p.queue_per_worker) == (1, 4, 3)
    assert (p.idle_s, p.cooldown_s) == (config.scale_down_idle_s, config.scale_cooldown_s)


# ---- reading a worker's metrics ------------------------------------------------------------


def test_parse_worker_metrics_reads_the_servers_own_names():
    metrics = ServerMetrics()
    for seconds in (0.02, 0.02, 0.3):
        metrics.ttft.observe(seconds)
    text = metrics.render({"num_waiting_reqs": 3, "num_running_reqs": 2, "cache_hit_rate": 0.5})
    parsed = parse_worker_metrics(text.decode())
    assert (parsed.num_waiting, parsed.num_running, parsed.hit_rate) == (3, 2, 0.5)
    assert parsed.ttft_buckets[-1] == (float("inf"), 3)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = ((0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0))
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.95)
    assert histogram_quantile(((1.0, 0.0), (float("inf"), 2.0)), 0.99) == 1.0
    assert histogram_quantile(((1.0, 0.0), (float("inf"), 0.0)), 0.99) is None


def test_ttft_window_counts_only_recent_requests():
    window = TTFTWindow(window_s=10)
    window.add(0, ((0.1, 0.0), (5.0, 0.0), (float("inf"), 0.0)))
    window.add(5, ((0.1, 0.0), (5.0, 100.0), (float("inf"), 100.0)))  # 100 slow ones
    assert window.p99() > 1
    window.add(16, ((0.1, 1000.0), (5.0, 1100.0), (float("inf"), 1100.0)))  # 1000 fast
    window.add(20, ((0.1, 1000.0), (5.0, 1100.0), (float("inf"), 1100.0)))
    assert window.p99() < 0.1  # the slow ones came before the window


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

SCALE_FLAGS = ["--scale-up-queue-per-worker", "1", "--scale-down-idle-s", "2"]
SCALE_FLAGS += ["--scale-interval-s", "0.5", "--scale-cooldown-s", "1"]
BURST = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
GROW_TIMEOUT_S = 120.0
SHRINK_TIMEOUT_S = 60.0


class AutoscaledFleet:
    """`radixserve fleet --min-workers 1 --max-workers 2` in a subprocess, one request running
    per worker so that a burst queues; `stats()` reads its fleet port."""

    def __init__(self, model: str):
        router_port, base, fleet_port, prom = (free_port_run(n) for n in (1, 2, 1, 1))
        self.url = f"http://127.0.0.1:{router_port}"
        self.fleet_url = f"http://127.0.0.1:{fleet_port}"
        command = [sys.executable, "-m", "radixserve.cli", "fleet", model, *SCALE_FLAGS]
        command += ["--min-workers", "1", "--max-workers", "2", "--policy", "round_robin"]
        command += ["--router-port", str(router_port), "--worker-base-port", str(base)]
        command += ["--fleet-port", str(fleet_port), "--max-total-tokens", "8192"]
        command += ["--max-running-requests", "1", "--router-args", f"--prometheus-port {prom}"]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if "fleet ready at" in line:
                break
        else:
            raise RuntimeError("fleet did not start:\n" + "".join(self.log))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def stats(self) -> dict:
        return json.loads(http(self.fleet_url + "/fleet/stats")[1])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(90)


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
        actions = [d["action"] for d in stats["decisions"]]
        assert actions == ["up", "down"], stats["decisions"]
        metrics = http(fleet.fleet_url + "/metrics")[1].decode()
        assert 'radixserve_fleet:scaling_decisions_total{action="up"} 1.0' in metrics
        assert "scale up to 2 workers" in "".join(fleet.log)
    finally:
        assert fleet.stop() == 0, "".join(fleet.log[-30:])
