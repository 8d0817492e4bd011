"""radixserve_bench without a server: workloads, theoretical hit rates, metrics, report files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from radixserve_bench.client import arrival_times
from radixserve_bench.hit_rate import PageTrie, max_hit_rate, max_hit_tokens
from radixserve_bench.metrics import (
    compute_metrics,
    latency_stats,
    peak_concurrency,
    peak_output_throughput,
    request_itls,
    request_tpot,
)
from radixserve_bench.record import BenchRun, RequestResult
from radixserve_bench.report import format_table, write_report
from radixserve_bench.workloads import (
    WORKLOADS,
    BenchRequest,
    Workload,
    make_workload,
    parse_overrides,
    placeholder_outputs,
    workload_config,
)

TINY = {
    "shared-prefix": "num_groups=2,prompts_per_group=3,system_len=32,question_len=8,output_len=4",
    "multi-turn": "num_conversations=3,num_turns=3,system_len=16,user_len=8,output_len=5",
    "agent": "num_agents=2,num_rounds=3,system_len=64,task_len=8,observation_len=8,output_len=4",
    "fork": "num_trees=2,fan_out=2,depth=2,context_len=32,branch_len=4,output_len=4",
    "agent-sessions": "num_sessions=2,num_turns=2,context_len=16,observation_len=4,output_len=4,"
    "num_flood=2,flood_len=8,flood_output_len=2",
    "tool-echo": "num_agents=2,num_rounds=2,system_len=32,num_records=2,output_len=6",
}


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve_bench.workloads import default_tokenizer

    return default_tokenizer()


def tiny(name: str, tokenizer, seed: int = 0) -> Workload:
    return make_workload(name, tokenizer, seed, "default", parse_overrides(TINY[name]))


# ---- workloads -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_deterministic(name, tokenizer):
    first, again, other = (tiny(name, tokenizer, s).prompts() for s in (0, 0, 1))
    assert first == again
    assert first != other


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_parents_come_first_and_prompts_extend_them(name, tokenizer):
    workload = tiny(name, tokenizer)
    outputs = placeholder_outputs(workload)
    prompts = workload.prompts(outputs)
    for i, req in enumerate(workload.requests):
        assert len(outputs[i]) == req.output_len
        if req.parent is not None:
            assert req.parent < i
            assert prompts[i] == prompts[req.parent] + outputs[req.parent] + req.new_ids


def test_tool_echo_asks_to_copy_a_json_tool_result(tokenizer):
    workload = tiny("tool-echo", tokenizer)
    assert [r.turn for r in workload.requests] == [0, 0, 1, 1]
    for req in workload.requests:
        text = tokenizer.decode(req.new_ids)
        assert "Tool result:\n[\n  {" in text and text.endswith("character for character:\n")
    assert tokenizer.decode(workload.requests[0].new_ids).count("{") == 2


def test_shared_prefix_shape(tokenizer):
    workload = tiny("shared-prefix", tokenizer)
    prompts = workload.prompts()
    assert len(prompts) == 6 and all(len(p) == 40 for p in prompts)
    by_group: dict[int, set] = {}
    for req, prompt in zip(workload.requests, prompts):
        by_group.setdefault(req.conversation, set()).add(tuple(prompt[:32]))
    assert [len(s) for s in by_group.values()] == [1, 1]  # one system prompt per group
    assert [r.conversation for r in workload.requests] != [0, 0, 0, 1, 1, 1]  # shuffled


def test_multi_turn_interleaves_turns(tokenizer):
    workload = tiny("multi-turn", tokenizer)
    assert [r.turn for r in workload.requests] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.conversation for r in workload.requests[:3]] == [0, 1, 2]
    assert workload.requests[4].parent == 1


def test_fork_fans_out_level_by_level(tokenizer):
    workload = tiny("fork", tokenizer)
    assert len(workload.requests) == 2 * (1 + 2 + 4)
    assert [r.turn for r in workload.requests] == [0] * 2 + [1] * 4 + [2] * 8
    assert [r.parent for r in workload.requests[2:6]] == [0, 0, 1, 1]


def test_presets_and_overrides():
    assert workload_config("shared-prefix").num_groups == 64
    small = workload_config("shared-prefix", "small", {"output_len": 7})
    assert (small.num_groups, small.system_len, small.output_len) == (8, 1024, 7)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_config("nope")
    with pytest.raises(ValueError, match="unknown preset"):
        workload_config("fork", "huge")
    with pytest.raises(ValueError, match="bogus"):
        workload_config("fork", overrides={"bogus": 1})
    with pytest.raises(ValueError, match="name=value"):
        parse_overrides("num_groups")


# ---- theoretical hit rate ------------------------------------------------------------------


def test_hit_rate_counts_whole_shared_pages():
    shared = list(range(8))
    prompts = [shared + [100, 101, 102, 103], shared + [200, 201, 202, 203]]
    assert max_hit_tokens(prompts, page_size=4) == [0, 8]
    assert max_hit_rate(prompts, page_size=4) == 8 / 24


def test_hit_rate_respects_page_size_and_last_token():
    six = list(range(6))
    assert max_hit_tokens([six + [7, 8], six + [9, 10]], page_size=4) == [0, 4]
    assert max_hit_tokens([six + [7, 8], six + [9, 10]], page_size=1) == [0, 6]
    same = list(range(8))
    assert max_hit_tokens([same, same], page_size=4) == [0, 4]  # at most len - 1
    assert max_hit_tokens([same, same], page_size=1) == [0, 7]


def test_hit_rate_counts_previous_answers_but_their_last_token():
    prompt, answer = list(range(8)), [50, 51, 52, 53, 54]
    follow_up = prompt + answer + [60, 61, 62]  # 16 tokens
    assert max_hit_tokens([prompt, follow_up], 4) == [0, 8]
    # cached after turn 1: prompt + answer[:-1] = 12 tokens = 3 pages
    assert max_hit_tokens([prompt, follow_up], 4, [answer, [1]]) == [0, 12]
    assert max_hit_rate([prompt, follow_up], 4, [answer, [1]]) == 12 / 24


def test_hit_rate_of_a_tiny_shared_prefix_workload(tokenizer):
    prompts = tiny("shared-prefix", tokenizer).prompts()
    # 2 groups x 3 prompts of 32 + 8 tokens: all but each group's first hit the 32-token system
    assert max_hit_rate(prompts, 16) == 4 * 32 / (6 * 40)


def test_page_trie_matches_whole_pages_only():
    trie = PageTrie(2)
    trie.insert([1, 2, 3, 4, 5])
    assert trie.match([1, 2, 3, 4, 5, 6]) == 4
    assert trie.match([1, 2, 3, 9]) == 2
    assert trie.match([1, 2, 3, 4], limit=3) == 2
    assert trie.match([2, 1]) == 0


# ---- metrics -------------------------------------------------------------------------------


def result(index=0, start=0.0, times=(0.1, 0.2, 0.4), tokens=(1, 1, 2), **kw) -> RequestResult:
    r = RequestResult(index, success=True, start_time=start, e2e=times[-1] if times else 0.0)
    r.chunk_times, r.chunk_tokens = list(times), list(tokens)
    r.output_len = sum(tokens)
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_itl_spreads_multi_token_chunks_and_tpot_skips_the_first_token():
    r = result()
    assert r.ttft == pytest.approx(0.1)
    assert request_itls(r) == pytest.approx([0.1, 0.1, 0.1])
    assert request_tpot(r) == pytest.approx((0.4 - 0.1) / 3)
    assert request_tpot(result(times=(0.3,), tokens=(1,))) is None


def test_latency_percentiles():
    stats = latency_stats("ttft", [1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats["mean_ttft_ms"] == pytest.approx(3000)
    assert stats["median_ttft_ms"] == pytest.approx(3000)
    assert stats["p90_ttft_ms"] == pytest.approx(4600)  # linear interpolation, as numpy/vLLM
    assert stats["p99_ttft_ms"] == pytest.approx(4960)
    assert stats["std_ttft_ms"] == pytest.approx(np.std([1, 2, 3, 4, 5]) * 1000)


def test_peaks():
    runs = [
        result(0, 0.0, (0.5, 1.0), (1, 1)),
        result(1, 0.5, (0.5, 1.5), (1, 1)),
        result(2, 1.5, (0.2, 1.5), (1, 1)),
    ]
    assert peak_concurrency(runs) == 2
    # token arrival seconds: 0.5, 1.0 | 1.0, 2.0 | 1.7, 3.0 -> second [1, 2) holds 3 tokens
    assert peak_output_throughput(runs) == 3


def test_compute_metrics_on_synthetic_timings():
    ok = [
        result(0, 0.0, (0.1, 0.2, 0.4), prompt_len=10, cached_tokens=0, prompt_ids=list(range(10))),
        result(1, 0.1, (0.3, 0.5, 0.9), prompt_len=10, cached_tokens=8, prompt_ids=list(range(10)),
               turn=1),
    ]  # fmt: skip
    failed = RequestResult(2, error="boom")
    m = compute_metrics([*ok, failed], duration=2.0, page_size=4)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["concurrency"] == pytest.approx((0.4 + 0.9) / 2)
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["mean_ttft_followup_ms"] == pytest.approx(300)
    assert m["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)
    assert m["cache_hit_rate"] == pytest.approx(8 / 20)
    assert m["max_cache_hit_rate"] == pytest.approx(8 / 20)  # (10 - 1) // 4 pages of 4
    assert m["cache_hit_rate_of_max"] == pytest.approx(1.0)


def test_arrival_times():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(0.1, rel=0.1)


# ---- report --------------------------------------------------------------------------------


def test_table_json_and_plots(tmp_path):
    results = [result(0, prompt_len=10, prompt_ids=list(range(10)))]
    run = BenchRun("sys-a", "offline", compute_metrics(results, 1.0, 4), results)
    run.metrics |= {"max_concurrency": None, "request_rate": math.inf}
    table = format_table([run, run], "shared-prefix")
    assert "Mean TTFT (ms):" in table and "P99 E2EL (ms):" in table and "sys-a" in table
    paths = write_report(tmp_path, [run], {"workload": "test", "load": {"rate": math.inf}})
    assert sorted(p.name for p in paths) == [
        "bench.json", "hit_rate.png", "latency_cdf.png", "throughput.png",
    ]  # fmt: skip
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["load"]["rate"] == "inf"
    assert doc["runs"][0]["metrics"]["completed"] == 1
    assert doc["runs"][0]["requests"][0]["chunk_times"] == [0.1, 0.2, 0.4]
    assert {"python", "torch", "cpu", "git_commit"} <= set(doc["environment"])
    assert all(p.stat().st_size > 1000 for p in paths)


def test_request_graph_placeholders_never_collide():
    workload = Workload("w", [BenchRequest(None, [1, 2], 3), BenchRequest(0, [4], 2)])
    outputs = placeholder_outputs(workload)
    assert outputs == [[-1, -2, -3], [-4, -5]]
    assert workload.prompts() == [[1, 2], [1, 2, -1, -2, -3, 4]]
