"""`radixserve bench simulate`: the real scheduler on a cost model reproduces the engine's cache
hits, charges hand-computable virtual time, separates policies, and writes its report."""

from __future__ import annotations

import json

import pytest

from conftest import make_engine
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve_bench.offline import run_offline
from radixserve_bench.sim_runner import CostModel
from radixserve_bench.simulate import SimLoad, simulate
from radixserve_bench.workloads import BenchRequest, Workload, make_workload, parse_overrides

SHARED_PREFIX = "num_groups=3,prompts_per_group=4,system_len=64,question_len=8,output_len=4"
MULTI_TURN = "num_conversations=3,num_turns=3,system_len=32,user_len=8,output_len=6"
LONG_ANSWERS = "num_conversations=4,num_turns=2,system_len=16,user_len=8,output_len=48"


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve_bench.workloads import default_tokenizer

    return default_tokenizer()


def workload(name: str, spec: str, tokenizer, seed: int = 0) -> Workload:
    return make_workload(name, tokenizer, seed, overrides=parse_overrides(spec))


# ---- the simulator reproduces the engine -----------------------------------------------------

ENGINE_CASES = [  # workload, its sizes, policy, KV pool tokens, max concurrency
    ("shared-prefix", SHARED_PREFIX, "lpm", 8192, None),
    ("shared-prefix", SHARED_PREFIX, "dfs-weight", 192, 3),  # evicts
    ("multi-turn", MULTI_TURN, "fcfs", 8192, 2),
    ("multi-turn", LONG_ANSWERS, "lpm", 320, None),  # evicts and retracts
]


@pytest.mark.parametrize("name,spec,policy,cache_tokens,concurrency", ENGINE_CASES)
def test_simulator_reproduces_the_engines_cache_hits(
    tiny_chat_model, tokenizer, name, spec, policy, cache_tokens, concurrency
):
    """Same admissions in the same order under the same page budget: the scheduler never reads
    token values except to match prefixes, and answers only extend their own conversation."""
    scheduler = dict(schedule_policy=policy, chunked_prefill_size=48, max_running_requests=8)
    cache = dict(page_size=16, max_total_tokens=cache_tokens)
    engine = make_engine(tiny_chat_model, **scheduler, **cache)
    try:
        reqs = workload(name, spec, tokenizer)
        real = run_offline(engine, reqs, concurrency, progress=False).info["engine_counters"]
    finally:
        engine.shutdown()
    load = SimLoad(max_concurrency=concurrency)
    sim = simulate(reqs, SchedulerConfig(**scheduler), CacheConfig(**cache), load=load).stats
    keys = ("cached_tokens", "prompt_tokens", "forward_steps", "evicted_pages", "retractions")
    assert {k: sim[k] for k in keys} == {k: real[k] for k in keys}
    assert sim["cached_tokens"] > 0


# ---- virtual time ----------------------------------------------------------------------------


def test_cost_model_counts_prefill_decode_and_kv_reads():
    cost = CostModel(step_overhead=1.0, prefill_cost=0.1, decode_cost=0.01, kv_cost=0.001)
    # a 5-token chunk on 3 cached tokens, two decodes at 10 and 20 tokens
    seconds = cost.step_seconds([5, 1, 1], [3, 10, 20])
    assert seconds == pytest.approx(1.0 + 5 * 0.1 + 2 * 0.01 + (8 + 11 + 21) * 0.001)


def test_virtual_clock_is_the_sum_of_step_costs():
    """Two 10-token prompts, 3 answer tokens each, all at once: one prefill step that samples
    the first tokens, then two decode steps at sequence lengths 11 and 12."""
    reqs = [BenchRequest(None, [100] * 10, 3), BenchRequest(None, [200] * 10, 3)]
    cost = CostModel(step_overhead=1.0, prefill_cost=0.1, decode_cost=0.01, kv_cost=0.001)
    result = simulate(
        Workload("hand", reqs), SchedulerConfig(), CacheConfig(max_total_tokens=256), cost
    )
    prefill = 1.0 + 20 * 0.1 + 20 * 0.001
    decodes = 2 * 1.0 + 4 * 0.01 + (11 + 11 + 12 + 12) * 0.001
    assert result.makespan == pytest.approx(prefill + decodes)
    assert len(result.step_cpu_s) == 3 and result.step_num_reqs == [2, 2, 2]
    for times in result.requests:
        assert (times.sent, times.admitted) == (0.0, 0.0)
        assert times.first_token == pytest.approx(prefill)
        assert times.finished == pytest.approx(prefill + decodes)
    assert [len(o) for o in result.outputs] == [3, 3]


def test_arrivals_and_concurrency_on_the_virtual_clock():
    """A request held back by max_concurrency is sent when its predecessor's slot frees."""
    reqs = [BenchRequest(None, [100 + i] * 10, 2) for i in range(2)]
    cost = CostModel(step_overhead=1.0, prefill_cost=0.0, decode_cost=0.0, kv_cost=0.0)
    result = simulate(
        Workload("hand", reqs), SchedulerConfig(), CacheConfig(max_total_tokens=256), cost,
        SimLoad(max_concurrency=1),
    )  # fmt: skip
    first, second = result.requests
    assert (first.sent, first.finished) == (0.0, 2.0)
    assert (second.sent, second.admitted, second.finished) == (2.0, 2.0, 4.0)
    assert result.makespan == 4.0


# ---- policies at scale -----------------------------------------------------------------------


def test_lpm_beats_fcfs_under_a_small_cache(tokenizer):
    spec = "num_groups=8,prompts_per_group=8,system_len=256,question_len=16,output_len=8"
    reqs = workload("shared-prefix", spec, tokenizer)
    rates = {}
    for policy in ("lpm", "fcfs"):
        config = SchedulerConfig(schedule_policy=policy, max_running_requests=16)
        result = simulate(reqs, config, CacheConfig(max_total_tokens=1024))
        rates[policy] = result.stats["cache_hit_rate"]
    assert rates["lpm"] > rates["fcfs"] + 0.05


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_admission_that_evicts_a_queued_match_rematches_it(tokenizer, policy):
    """dfs-weight once locked a node that an earlier admission in the same step had evicted."""
    spec = "num_groups=8,prompts_per_group=8,system_len=256,question_len=16,output_len=8"
    reqs = workload("shared-prefix", spec, tokenizer)
    config = SchedulerConfig(schedule_policy=policy, max_running_requests=16)
    result = simulate(reqs, config, CacheConfig(max_total_tokens=1024))
    assert result.stats["evicted_pages"] > 0
    assert all(not t.error and t.finished is not None for t in result.requests)


# ---- the CLI ---------------------------------------------------------------------------------


def test_simulate_cli_writes_a_table_and_json(tmp_path, capsys):
    from radixserve.cli import main

    out = tmp_path / "sim"
    argv = ["bench", "simulate", "--workload", "multi-turn", "--workload-args", MULTI_TURN,
            "--policies", "lpm,fcfs", "--cache-tokens", "512,4096", "--request-rate", "2",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0  # through the `radixserve` command, as a user runs it
    table = capsys.readouterr().out
    assert "cpu@max" in table and table.count("lpm") == 2
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["environment"]["python"] and doc["config"]["num_requests"] == 9
    runs = doc["runs"]
    assert [(r["policy"], r["cache_tokens"]) for r in runs] == [
        ("lpm", 512), ("fcfs", 512), ("lpm", 4096), ("fcfs", 4096)
    ]  # fmt: skip
    for run in runs:
        assert run["completed"] == 9 and run["failed"] == 0
        assert 0 < run["cache_hit_rate"] <= run["max_cache_hit_rate"]
        assert run["mean_ttft_ms"] >= run["mean_queue_ms"] >= 0
        assert run["steps"] > 0 and run["mean_cpu_ms"] > 0


def test_a_host_tier_in_the_grid_keeps_what_the_small_pool_loses(tokenizer):
    from radixserve_bench.simulate_cli import SimulateArgs, run_grid

    reqs = workload("multi-turn", LONG_ANSWERS, tokenizer)
    rates = {}
    for ratio in (0.0, 8.0):
        sim = SimulateArgs(
            policies="lpm",
            cache_tokens="320",
            hicache_ratio=ratio,
            schedule_tier_match_weight=0.9,
            progress=False,
        )
        (row,) = run_grid(reqs, sim, CostModel())
        assert row["failed"] == 0
        rates[ratio] = row["cache_hit_rate"]
    assert rates[8.0] > rates[0.0]
