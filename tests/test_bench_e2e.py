"""`radixserve bench` end to end on a tiny model: against the `server` fixture (native and
OpenAI backends) and offline through the Engine; each writes bench.json and the PNG plots."""

from __future__ import annotations

import json

import pytest

from conftest import make_engine
from radixserve.cli import main
from radixserve_bench.offline import run_offline
from radixserve_bench.workloads import make_workload, parse_overrides

SHARED_PREFIX = "num_groups=2,prompts_per_group=3,system_len=64,question_len=8,output_len=4"
MULTI_TURN = "num_conversations=2,num_turns=3,system_len=32,user_len=8,output_len=6"
FORK = "num_trees=2,fan_out=2,depth=1,context_len=48,branch_len=4,output_len=3"


def read_report(out_dir) -> dict:
    for name in ("throughput.png", "latency_cdf.png", "hit_rate.png"):
        assert (out_dir / name).read_bytes()[:4] == b"\x89PNG"
    return json.loads((out_dir / "bench.json").read_text())


@pytest.mark.parametrize("backend", ["radixserve", "openai"])
def test_bench_serve_writes_report_with_cache_hits(server, tmp_path, capsys, backend):
    out = tmp_path / backend
    argv = ["bench", "serve", "--url", server.url, "--backend", backend, "--workload",
            "shared-prefix", "--workload-args", SHARED_PREFIX, "--max-concurrency", "2",
            "--num-warmup", "1", "--out", str(out), "--no-progress"]  # fmt: skip
    if backend == "openai":
        argv += ["--model", "tiny"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "Cache hit rate:" in table
    run = read_report(out)["runs"][0]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (6, 0)
    assert metrics["total_output_tokens"] == 6 * 4
    assert metrics["max_cache_hit_rate"] == pytest.approx(4 * 64 / (6 * 72))
    assert 0 < metrics["cache_hit_rate"] <= metrics["max_cache_hit_rate"]
    assert metrics["mean_ttft_ms"] > 0 and metrics["p99_e2el_ms"] >= metrics["p99_ttft_ms"]
    assert all(len(r["chunk_times"]) >= 1 for r in run["requests"])


def test_bench_serve_multi_turn_feeds_real_answers(server, tmp_path):
    out = tmp_path / "multi"
    argv = ["bench", "serve", "--url", server.url, "--workload", "multi-turn", "--workload-args",
            MULTI_TURN, "--request-rate", "50", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    metrics = read_report(out)["runs"][0]["metrics"]
    assert metrics["completed"] == 6
    assert metrics["mean_ttft_followup_ms"] > 0
    assert metrics["cache_hit_rate_of_max"] > 0.5


def test_offline_multi_turn_reaches_the_optimum(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    try:
        workload = make_workload("multi-turn", engine.tokenizer, 0, overrides=parse_overrides(
            MULTI_TURN))  # fmt: skip
        run = run_offline(engine, workload, max_concurrency=2, progress=False)
    finally:
        engine.shutdown()
    m = run.metrics
    assert (m["completed"], m["total_output_tokens"]) == (6, 36)
    assert m["cache_hit_rate"] == pytest.approx(m["max_cache_hit_rate"])
    assert run.info["engine_counters"]["num_requests"] == 6
    for r in run.results:
        assert len(r.output_ids) == 6 and sum(r.chunk_tokens) == 6


def test_bench_offline_cli(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "offline"
    argv = ["bench", "offline", "--model", tiny_chat_model, "--max-total-tokens", "8192",
            "--workload", "fork", "--workload-args", FORK, "--max-concurrency", "4",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "Hit rate / optimum:" in capsys.readouterr().out
    doc = read_report(out)
    assert doc["config"]["mode"] == "offline" and doc["config"]["num_requests"] == 6
    assert doc["runs"][0]["metrics"]["completed"] == 6
    assert doc["runs"][0]["metrics"]["cache_hit_rate"] > 0


def test_bench_offline_rejects_a_request_rate(tiny_chat_model):
    with pytest.raises(SystemExit, match="max-concurrency"):
        main(["bench", "offline", "--model", tiny_chat_model, "--request-rate", "2"])
