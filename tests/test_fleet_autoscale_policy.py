"""The autoscaling policy as a pure function of metric samples (fleet/autoscale.py): the
queue and TTFT up signals, idle drains, hysteresis; and reading a worker's /metrics into
those samples (fleet/autoscale_scrape.py). No process is started here."""

from __future__ import annotations

import pytest

from radixserve.config import FleetConfig
from radixserve.fleet.autoscale import UP_SAMPLES, FleetSample, ScalingPolicy, WorkerSample
from radixserve.fleet.autoscale_scrape import (
    TTFTWindow,
    count_over,
    histogram_quantile,
    parse_worker_metrics,
)
from radixserve.server.metrics import ServerMetrics


def policy(**overrides) -> ScalingPolicy:
    args = dict(min_workers=1, max_workers=3, queue_per_worker=2, idle_s=10, cooldown_s=5)
    return ScalingPolicy(**(args | overrides))


def sample(t: float, *queues: tuple[float, ...], starting: int = 0) -> FleetSample:
    """Workers w0, w1, ... with (waiting, running[, first tokens, slow first tokens]) each."""
    workers = tuple(WorkerSample(f"w{i}", *q) for i, q in enumerate(queues))
    return FleetSample(t, workers, starting)


# ---- the policy ------------------------------------------------------------------------------


def test_a_queue_two_scrapes_long_adds_one_worker_then_cools_down():
    p = policy()
    assert p.decide(sample(0, (4, 1))).action == "hold"  # one scrape: a blip
    up = p.decide(sample(1, (4, 1)))
    assert (up.action, up.desired, up.rule) == ("up", 2, "queue")
    assert "--scale-up-queue-per-worker" in up.reason
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
    assert (down.action, down.worker, down.desired, down.rule) == ("down", "w1", 1, "idle")
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


def test_a_worker_whose_metrics_did_not_answer_still_counts():
    """A loaded worker's /metrics timing out must not read as a missing worker (an up at
    --max-workers, or one below --min-workers)."""
    p = policy(max_workers=2, min_workers=2)
    queued = FleetSample(0, (WorkerSample("w0", 4, 1),), num_unanswered=1)
    assert p.decide(queued).action == "hold"  # 2 workers: at --min and --max
    assert p.decide(FleetSample(1, queued.workers, num_unanswered=1)).action == "hold"
    p = policy(ttft_target_s=0.5, cooldown_s=0, max_workers=2)  # busy one silent, new one idle
    p.decide(sample(0, (3, 1, 4, 4), (0, 0)))
    quiet = FleetSample(20, (WorkerSample("w1", 0, 0),), num_unanswered=1)
    assert (p.decide(quiet).rule, p.decide(quiet).rule) == ("unanswered", "unanswered")
    assert p.last_slow_fraction == 1  # kept: nothing is known of the silent worker


def test_policy_from_config_takes_the_flags():
    config = FleetConfig(min_workers=1, max_workers=4, scale_up_queue_per_worker=3)
    p = ScalingPolicy.from_config(config)
    assert (p.min_workers, p.max_workers, p.queue_per_worker) == (1, 4, 3)
    assert (p.idle_s, p.cooldown_s) == (config.scale_down_idle_s, config.scale_cooldown_s)
    assert p.ttft_target_s == 0  # the TTFT signal is off unless asked for
    config = FleetConfig(min_workers=1, max_workers=2, scale_up_ttft_target_s=0.5)
    p = ScalingPolicy.from_config(config)
    assert (p.ttft_target_s, p.ttft_slow_fraction) == (0.5, config.scale_up_ttft_slow_fraction)


# ---- the TTFT signal -------------------------------------------------------------------------


def test_slow_first_tokens_two_scrapes_long_add_a_worker_with_no_queue():
    """No request waits (each worker runs what it gets), yet 3 of 10 first tokens came after
    the target, summed over the workers: the ttft rule adds a worker; the same load without a
    target holds."""
    p = policy(ttft_target_s=0.5, ttft_slow_fraction=0.2)
    assert p.decide(sample(0, (0, 2, 10, 3))).action == "hold"
    up = p.decide(sample(1, (0, 2, 6, 1), (0, 2, 4, 2)))  # 3 of 10 over the fleet
    assert (up.action, up.desired, up.rule) == ("up", 3, "ttft")
    assert "30% of first tokens slower than --scale-up-ttft-target-s 0.5" in up.reason
    off = policy()
    assert {off.decide(sample(t, (0, 2, 10, 3))).action for t in range(5)} == {"hold"}


def test_the_ttft_signal_under_its_fraction_or_with_no_first_tokens_is_low():
    p = policy(ttft_target_s=0.5, ttft_slow_fraction=0.2, cooldown_s=0)
    for t in range(4):  # 1 in 10 slow; then scrapes in which no first token came
        assert p.decide(sample(t, (0, 1, 10, 1) if t % 2 else (0, 1))).action == "hold"
    assert sample(0, (0, 1)).ttft_slow_fraction is None


def test_a_scrape_without_first_tokens_keeps_the_slow_share_until_all_is_idle():
    """Answers longer than a scrape interval: no first token between two scrapes, still slow
    while anything runs (a new worker the router has not used yet is not drained then)."""
    p = policy(ttft_target_s=0.5, queue_per_worker=100, cooldown_s=0, idle_s=1, max_workers=2)
    p.decide(sample(0, (0, 1, 4, 4), (0, 0)))
    for t in (1, 2, 3):  # nothing came, nothing waits, w0 runs one: still high, w1 kept
        assert p.decide(sample(t, (0, 1), (0, 0))).action == "hold"
        assert p.num_high == t + 1
    p = policy(ttft_target_s=0.5, queue_per_worker=100)
    p.decide(sample(0, (1, 2, 4, 4)))
    assert p.decide(sample(1, (1, 2))).rule == "ttft"  # nothing came, one waits: still high
    p = policy(ttft_target_s=0.5, queue_per_worker=100)
    p.decide(sample(0, (1, 2, 4, 4)))
    assert p.decide(sample(1, (0, 0))).action == "hold"  # all idle: low
    assert p.num_high == 0


def test_a_high_ttft_signal_keeps_an_idle_worker_and_a_queue_is_named_first():
    p = policy(ttft_target_s=0.5, cooldown_s=0, max_workers=2)
    p.decide(sample(0, (0, 1, 4, 4), (0, 0)))
    assert p.decide(sample(20, (0, 1, 4, 4), (0, 0))).action == "hold"  # w1 idle 20 s
    p = policy(ttft_target_s=0.5)
    p.decide(sample(0, (4, 1, 4, 4)))
    assert p.decide(sample(1, (4, 1, 4, 4))).rule == "queue"  # both high: the queue named


def test_count_over_interpolates_inside_the_targets_bucket():
    buckets = ((0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 104.0))
    assert count_over(buckets, 0.5) == 14  # a bucket bound: exact
    assert count_over(buckets, 0.3) == pytest.approx(104 - 70)  # halfway through 50..90
    assert count_over(buckets, 0.05) == pytest.approx(104 - 25)
    assert count_over(buckets, 5.0) == 4  # past the last finite bound: the +Inf ones
    assert count_over((), 1.0) == 0


def test_ttft_window_counts_first_tokens_between_the_last_two_scrapes():
    metrics, window = ServerMetrics(), TTFTWindow()
    assert window.since_last(0.5) == (0, 0)

    def scrape(now: float) -> None:
        text = metrics.render({"num_waiting_reqs": 0, "num_running_reqs": 0}).decode()
        window.add(now, parse_worker_metrics(text).ttft_buckets)

    for seconds in (0.02, 3.0, 3.0):  # before the first scrape: not counted
        metrics.ttft.observe(seconds)
    scrape(0)
    for seconds in (0.02, 0.02, 0.02, 3.0):
        metrics.ttft.observe(seconds)
    scrape(1)
    assert window.since_last(1.0) == (4, 1)  # 1.0 is a bucket bound of the server's
    assert window.since_last(None) == (4, 0)
    scrape(2)
    assert window.since_last(1.0) == (0, 0)


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
