"""`radixserve bench compare`: the ideal-speedup arithmetic, the comparison rows, and a tiny
end-to-end run that starts two radixserve servers itself and writes the report."""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main
from radixserve_bench.compare import TokenCosts, compare_runs, format_comparison, ideal_speedup
from radixserve_bench.record import BenchRun
from radixserve_bench.systems import LaunchOptions, parse_systems, unavailable_reason

SHARED_PREFIX = "num_groups=2,prompts_per_group=3,system_len=64,question_len=8,output_len=4"


def test_ideal_speedup_prices_prefill_and_decode():
    costs = TokenCosts(prefill_s=0.002, decode_s=0.01)
    # 1000 prompt tokens, 80% shareable, 10 output tokens:
    # no sharing 1000*0.002 + 10*0.01 = 2.1 s; perfect sharing 200*0.002 + 0.1 = 0.5 s
    assert ideal_speedup(1000, 0.8, 10, costs) == pytest.approx(2.1 / 0.5)
    assert ideal_speedup(1000, 0.0, 10, costs) == pytest.approx(1.0)


def _run(system: str, duration: float, **metrics) -> BenchRun:
    base = {
        "completed": 4,
        "duration": duration,
        "total_input_tokens": 1000,
        "total_output_tokens": 10,
        "max_cache_hit_rate": 0.8,
        "cache_hit_rate_of_max": 0.99,
    }
    return BenchRun(system, "radixserve", base | metrics, [])  # fmt: skip


def test_compare_runs_rows_targets_and_followup_ratio():
    costs = TokenCosts(prefill_s=0.002, decode_s=0.01)
    runs = [
        _run("radixserve", 1.0, p99_ttft_followup_ms=10.0),
        _run("radixserve-no-cache", 3.8, p99_ttft_followup_ms=50.0),
        _run("hf-transformers", 5.0),
        _run("llama-cpp", 1.5),
        _run("radixserve-fcfs", 1.1, total_cached_tokens=800),
    ]
    comparison = compare_runs(runs, {"radixserve": costs})
    ideal = 2.1 / 0.5
    assert comparison["ideal_speedup"] == pytest.approx(ideal)
    rows = {r["system"]: r for r in comparison["rows"]}
    assert rows["radixserve-no-cache"]["speedup"] == pytest.approx(3.8)
    assert rows["radixserve-no-cache"]["of_ideal"] == pytest.approx(3.8 / ideal)
    assert rows["radixserve-no-cache"]["target"] == pytest.approx(0.85 * ideal)
    assert rows["radixserve-no-cache"]["p99_ttft_followup_ratio"] == pytest.approx(0.2)
    assert rows["hf-transformers"]["target"] == pytest.approx(ideal)
    assert rows["llama-cpp"]["target"] == 2.0
    assert "target" not in rows["radixserve-fcfs"]
    assert rows["radixserve-fcfs"]["ideal_speedup"] is None  # it shares prefixes itself
    table = format_comparison(comparison, {"radixserve": costs})
    assert "radixserve-no-cache" in table and "MISSED" in table  # llama-cpp: 1.5x < 2x
    assert "hit rate / optimum: 0.990" in table


def test_probe_prompts_share_exactly_the_requested_prefix():
    from radixserve_bench.compare import probe_workload

    decode = probe_workload("d", 4, 40, 5, seed=0, shared_len=32).prompts()
    assert all(len(p) == 40 and p[:32] == decode[0][:32] for p in decode)
    assert len({p[32] for p in decode}) == 4
    prefill = probe_workload("p", 4, 40, 1, seed=0).prompts()
    assert len({p[0] for p in prefill}) == 4


def test_ideal_is_priced_with_the_fastest_decode_and_printed_both_ways():
    costs = {
        "radixserve": TokenCosts(prefill_s=0.002, decode_s=0.01),
        "llama-server": TokenCosts(prefill_s=0.001, decode_s=0.005),
        "hf-transformers": TokenCosts(prefill_s=0.003, decode_s=0.0),  # probe told nothing
    }
    runs = [_run("radixserve", 1.0), _run("hf-transformers", 3.0)]
    comparison = compare_runs(runs, costs)
    # radixserve's prefill, llama-server's decode: (2 + 0.05) / (0.4 + 0.05)
    assert comparison["ideal_speedup"] == pytest.approx(2.05 / 0.45)
    assert comparison["ideal_speedup_own_decode"] == pytest.approx(2.1 / 0.5)
    assert comparison["decode_priced_by"] == "llama-server"
    assert comparison["rows"][0]["ideal_speedup"] == pytest.approx(2.05 / 0.45)
    table = format_comparison(comparison, costs)
    assert "ideal speedup: 4.20x with radixserve's decode, 4.56x with the fastest" in table
    assert "measured cost per token (llama-server): prefill 1.000 ms, decode 5.000 ms" in table


def test_compare_runs_without_reference_or_costs():
    assert compare_runs([_run("hf-transformers", 2.0)], {})["rows"] == []
    rows = compare_runs([_run("radixserve", 1.0), _run("hf-transformers", 2.0)], {})["rows"]
    assert rows[0]["ideal_speedup"] is None and rows[0]["speedup"] == pytest.approx(2.0)


def test_systems_are_checked(tiny_chat_model):
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        parse_systems("radixserve,vllm")
    llama = parse_systems("llama-cpp")[0]
    reason = unavailable_reason(llama, LaunchOptions(model=tiny_chat_model))
    assert reason is not None and ("gguf" in reason or "not installed" in reason)


def test_bench_compare_starts_measures_and_stops_systems(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "compare"
    argv = ["bench", "compare", "--systems", "radixserve,radixserve-no-cache,hf-transformers-cb",
            "--model", tiny_chat_model, "--server-args", "--max-total-tokens 16384",
            "--workload-args", SHARED_PREFIX, "--max-concurrency", "2", "--num-warmup", "1",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "radixserve vs peers" in printed and "measured cost per token" in printed
    report = json.loads((out / "bench.json").read_text())
    runs = {r["system"]: r["metrics"] for r in report["runs"]}
    assert set(runs) == {"radixserve", "radixserve-no-cache", "hf-transformers-cb"}
    assert all(m["completed"] == 6 and m["total_output_tokens"] == 24 for m in runs.values())
    assert runs["radixserve"]["total_cached_tokens"] > 0
    assert runs["radixserve-no-cache"]["total_cached_tokens"] == 0
    comparison = report["config"]["comparison"]
    assert set(report["config"]["token_costs"]) == set(runs)  # every system calibrated
    costs = report["config"]["token_costs"]["radixserve"]
    assert costs["prefill_s"] > 0 and costs["decode_s"] >= 0
    # the decode probe shared its prompts' prefix, so the radix server prefilled it once
    assert costs["probe"]["decode_prefilled_tokens"] < 2 * costs["probe"]["prompt_len"]
    assert comparison["ideal_speedup"] > 1
    rows = [r["system"] for r in comparison["rows"]]
    assert rows == ["radixserve-no-cache", "hf-transformers-cb"]
    assert "ideal_speedup_own_decode" in comparison and comparison["decode_priced_by"] in runs
    assert (out / "logs" / "radixserve.log").exists()


def test_llama_cpp_backend_sends_text_and_holds_off_eos():
    from radixserve_bench.backends import make_backend
    from radixserve_bench.workloads import default_tokenizer

    tokenizer = default_tokenizer()
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    backend = make_backend("llama-cpp", "http://127.0.0.1:1", tokenizer, "m", None)
    body = backend.payload(ids, 7)
    assert body["prompt"] == "The capital of France is"
    assert (body["max_tokens"], body["min_tokens"], body["repeat_penalty"]) == (7, 7, 1.0)
    assert body["temperature"] == 0.0 and body["stream"] is True


def test_llama_cpp_command_keeps_concurrent_streams():
    from radixserve_bench.systems import SYSTEMS, server_command

    command = server_command(SYSTEMS["llama-cpp"], LaunchOptions(), 1234, 16)
    assert command[command.index("--interrupt_requests") + 1] == "False"
    assert command[command.index("--model") + 1].endswith(".gguf")


def test_a_run_cut_short_gets_no_speedup():
    runs = [_run("radixserve", 1.0), _run("llama-server", 2.0, failed=62, completed=2)]
    [row] = compare_runs(runs, {})["rows"]
    assert row["speedup"] is None and row["completed"] == 2 and row["target"] == 2.0
    assert "llama-server" in format_comparison(compare_runs(runs, {}), {})
