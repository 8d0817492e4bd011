"""The soak (benchmarks/soak.py) against a real server: 300 mixed requests through a 64-page
KV pool with faults injected; afterwards no page is leaked, nothing got a 5xx, the page
accounting checks out, every fault-rid request was aborted and every other one finished
normally or was cut short on purpose."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402

NUM_REQUESTS = 300


@pytest.fixture
def soak_server(tiny_chat_model, monkeypatch):
    for key, value in soak.server_env(faults=True).items():
        monkeypatch.setenv(key, value)
    proc = ServerProcess(tiny_chat_model, *soak.SERVER_FLAGS)
    yield proc
    try:
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


@pytest.mark.slow
def test_soak_mixed_requests_leak_nothing(soak_server):
    report = soak.run_soak(soak_server.url, soak.SoakConfig(num_requests=NUM_REQUESTS))
    failed = {name: check for name, check in report["checks"].items() if not check["ok"]}
    assert not failed, (failed, report["problems"][:10])
    assert report["status_codes"] == {"200": NUM_REQUESTS}
    pages = report["server"]["pages_after_flush"]
    assert pages["ok"] and pages["pool_free_pages"] == pages["pool_capacity_pages"]
    num_faults = report["faults_injected"]
    assert num_faults > 0 and report["aborted"]["by_injected_fault"] == num_faults
    assert report["aborted"]["hung_up_by_client"] > 0
    assert report["aborted"]["by_abort_request"] > 0
    server = report["server"]
    assert server["evicted_pages"] > 0 and server["retractions"] > 0, server
    assert server["cache_hit_rate"] > 0.1, server
    features = report["features"]
    for feature in ("shared", "long", "n>1", "logprobs", "constrained", "regex", "json_schema"):
        assert features.get(feature, 0) > 0, features
