"""Every bug the flag fuzz (tests/test_flag_fuzz.py) found, as an explicit example. Each was
an exception that named no flag (TypeError, OverflowError, RuntimeError from torch), a
traceback from the engine core's process or from after the model had loaded, or a nonsense
value accepted that broke later (or was silently ignored); each is now refused at start,
naming the flag. The comment on each case says what it did before."""

from __future__ import annotations

import re

import pytest
from flag_fuzz_cases import INF, NAN, REFUSALS, run_cli, stub_starts

from radixserve import Engine
from radixserve.config import (
    CacheConfig,
    DisaggregationConfig,
    FleetConfig,
    ParallelConfig,
    SchedulerConfig,
)
from radixserve.engine.preflight import verify_engine_args
from radixserve.fleet.launch import worker_engine_args

ENGINE_CASES = [
    # a float size reached torch.empty (TypeError from torch)
    ({"page_size": 16.0}, r"page_size \(--page-size\) must be an int; got 16.0"),
    ({"max_total_tokens": 4096.5}, r"max_total_tokens \(--max-total-tokens\) must be an int"),
    ({"page_size": "16"}, r"page_size .* must be an int; got '16'"),  # '<' on str and int
    ({"page_size": True}, r"page_size .* must be an int; got True"),  # ran as pages of 1
    # NaN crashed the first engine step (int(nan) in admission); inf overflowed int()
    ({"schedule_conservativeness": NAN}, r"--schedule-conservativeness.* got nan"),
    ({"schedule_conservativeness": INF}, "schedule_conservativeness must be a number >= 0"),
    ({"schedule_conservativeness": -1}, "schedule_conservativeness must be a number >= 0"),
    ({"device": "bogus"}, "--device must be auto, cpu, cuda or cuda:N"),  # torch's RuntimeError
    ({"device": "meta"}, "--device must be auto, cpu, cuda or cuda:N"),  # generated nothing
    ({"device": "cuda:9"}, r"--device cuda:9: this machine has \d+ CUDA devices"),
    ({"mem_fraction_static": 0}, r"--mem-fraction-static must be in \(0, 1\]"),  # accepted
    ({"cpu_kv_cache_gb": INF}, "--cpu-kv-cache-gb must be > 0"),  # OverflowError sizing the pool
    ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs must be >= 1"),  # accepted on CPU
    # capture_batch_sizes' OverflowError once the model had loaded; 10**6: ~125k compiles
    ({"enable_torch_compile": True, "torch_compile_max_bs": 10**30}, "--torch-compile-max-bs"),
    # OverflowError sizing the tier
    ({"enable_hierarchical_cache": True, "hicache_size": INF}, "--hicache-size must be > 0"),
    ({"enable_hierarchical_cache": True, "hicache_ratio": INF}, "--hicache-ratio must be > 0"),
    ({"context_length": 0}, "context_length must be >= 1"),  # silently the model's
    ({"context_length": -1}, "context_length must be >= 1"),  # every request refused
    ({"tp_size": 2, "dist_timeout": 1e30}, r"--dist-timeout must be seconds in \(0, "),
    # ignored while --speculative-algorithm was unset
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be >= 1"),
    ({"speculative_suffix_min_token_prob": 1.5}, r"speculative_suffix_min_token_prob must be"),
    ({"speculative_eagle_topk": -1}, "speculative_eagle_topk must be >= 1"),
    ({"load_format": "dummy", "seed": 2**64}, "--seed must fit in 64 bits"),  # torch's overflow
    ({"lora_paths": ["\x00=/x"]}, "--lora-paths entry"),  # named `lora_name`, a request field
    ({"model": ""}, "--model must be a path or a built-in config name"),  # '. holds neither'
    # serve: the core process's traceback; STANDALONE: found after the target had loaded
    ({"model": "/no/such/model"}, "--model: model not found"),
    (
        {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/no/such"},
        "--speculative-draft-model-path: model not found",
    ),
    # both found once the model had loaded
    (
        {"disaggregation_mode": "prefill", "disaggregation_secret_file": "/no/such/secret"},
        "--disaggregation-secret-file /no/such/secret: cannot read it",
    ),
    (
        {"disaggregation_mode": "prefill", "disaggregation_bootstrap_host": "1.5"},
        "--disaggregation-bootstrap-host must be an IP address or a host name",
    ),
    ({"quantization": "bogus"}, "--quantization must be one of"),  # checked only while loading
    ({"attention_backend": "bogus"}, "--attention-backend must be one of"),  # likewise
]


@pytest.mark.parametrize(("kwargs", "message"), ENGINE_CASES)
def test_bad_engine_keywords_are_refused_before_loading_naming_them(kwargs, message):
    with pytest.raises(REFUSALS, match=message):
        verify_engine_args(None, kwargs)


@pytest.mark.parametrize(
    ("make", "message"),
    [  # NaN / inf slipped through `x <= 0` checks of configs built directly
        (lambda: ParallelConfig(dist_timeout=NAN).verify(), "--dist-timeout"),
        (
            lambda: DisaggregationConfig(disaggregation_transfer_timeout=NAN).verify(
                SchedulerConfig(), 1
            ),
            "--disaggregation-transfer-timeout must be > 0",
        ),
        (
            lambda: SchedulerConfig(speculative_adaptive_threshold=NAN).verify(),
            "speculative_adaptive_threshold must be >= 0",
        ),
        (
            lambda: SchedulerConfig(speculative_suffix_max_spec_factor=INF).verify(),
            "speculative_suffix_max_spec_factor must be > 0",
        ),
        (lambda: CacheConfig(mem_fraction_static=NAN), "--mem-fraction-static"),
    ],
)
def test_nan_and_inf_in_configs_built_directly_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [  # sized by the loaded model: torch's "can't allocate memory" RuntimeError, or a pool
        # that gets the process killed as its pages are touched
        ({"max_total_tokens": 10**12}, r"a KV pool of \d+ tokens takes .*--max-total-tokens"),
        ({"cpu_kv_cache_gb": 1e9}, r"a KV pool .* more than the .* GiB free .*--cpu-kv-cache-gb"),
        ({"context_length": 10**11}, r"a RoPE table of 10+ positions \(--context-length\)"),
        # named only max_total_tokens
        ({"max_total_tokens": 4096, "page_size": 2**20}, r"holds no page .* \(--page-size\)"),
    ],
)
def test_what_the_loaded_model_sizes_is_refused_naming_the_flag(tiny_chat_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_chat_model, **kwargs)


def test_eagle3_in_lower_case_gets_the_default_models_head():
    """It asked for --speculative-draft-model-path, while EAGLE3 used the shipped head."""
    scheduler = verify_engine_args(None, {"speculative_algorithm": "eagle3"}).scheduler
    assert scheduler.speculative_algorithm == "EAGLE3"
    assert scheduler.speculative_draft_model_path is not None


CLI_CASES = [
    # logging.basicConfig's ValueError traceback in main, for every command
    (["serve", "--log-level", "bogus"], "argument --log-level: must be debug"),
    (["generate", "hi", "--log-level", "bogus"], "argument --log-level: must be debug"),
    # the engine core process's traceback, then "engine core exited with code 1"
    (["serve", "--page-size", "0"], "radixserve serve: --page-size must be >= 1"),
    (["serve", "--model", "/no/such/model"], "radixserve serve: --model: model not found"),
    # tracebacks from engine.generate once the model had loaded
    (["generate", "hi", "--temperature=-1"], "radixserve generate: temperature must be"),
    (["generate", "hi", "--top-p", "nan"], "radixserve generate: top_p must be"),
    (["generate", "hi", "--max-new-tokens=-1"], "radixserve generate: max_new_tokens must be"),
    (["generate", "hi", "--lora-path", "x"], "--lora-path 'x' is not an adapter of --lora-paths"),
    # accepted, then bind failed once the model had loaded
    (["serve", "--port", "70000"], r"port must be in \[0, 65535\]; got 70000"),
    (["serve", "--host", ""], "host must be an IP address or a host name; got ''"),
    (["serve", "--host", "1.5"], "host must be an IP address or a host name; got '1.5'"),
    (["serve", "--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve"),
    (["serve", "--max-queued-requests=-1"], "max_queued_requests must be >= 0"),  # accepted
    # OverflowError in int() once the model had loaded
    (["serve", "--max-body-mb", "inf"], "max_body_mb must be a number > 0; got inf"),
    (["serve", "--responses-store-max-mb", "inf"], "responses_store_max_mb must be a number"),
    (["serve", "--served-model-name", " "], "served_model_name must name the model"),
    # the workers or the router failed to bind
    (["fleet", "--workers", "2", "--worker-base-port", "65535"], "--worker-base-port 65535 \\+"),
    (["fleet", "--router-port", "0"], r"--router-port must be in \[1, 65535\]"),
    (["fleet", "--fleet-host", "0x10"], "--fleet-host must be an IP address or a host name"),
    # never checked / checked only when autoscaling, and not for NaN
    (["fleet", "--startup-timeout-s", "nan"], "--startup-timeout-s must be a number > 0"),
    (["fleet", "--scale-up-ttft-slow-fraction", "nan"], "--scale-up-ttft-slow-fraction must"),
    (
        ["fleet", "--min-workers", "1", "--max-workers", "2", "--scale-interval-s", "1e30"],
        "--scale-interval-s must be at most",  # overflowed the autoscaler's Event.wait
    ),
    (["fleet", "--router-args", '"'], "--router-args must be shell-quoted flags"),  # shlex's
    # refused by every worker as it started
    (["fleet", "--page-size", "0"], "radixserve fleet: --page-size must be >= 1"),
    (["fleet", "--reasoning-parser", "bogus"], "radixserve fleet: .*bogus"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_CASES)
def test_bad_command_lines_are_refused_before_anything_starts(monkeypatch, argv, message):
    stub_starts(monkeypatch)
    refusal = run_cli(argv)
    assert refusal is not None, f"{argv} was accepted"
    assert re.search(message, refusal), refusal


def test_a_prefill_workers_bootstrap_port_past_65535_is_refused():
    """Prefill worker i serves on --disaggregation-bootstrap-port + i: 65536 failed to bind."""
    config = FleetConfig(prefill_workers=2, decode_workers=1)
    with pytest.raises(ValueError, match="--disaggregation-bootstrap-port .* at most 65535"):
        worker_engine_args({"disaggregation_bootstrap_port": 65535}, 1, config)


def test_numpy_numbers_are_held_as_python_numbers():
    """`Engine(page_size=np.int64(16))` (a size computed with numpy) was refused as not an
    int; numpy integers and reals are now taken, stored as Python ints and floats, while a
    numpy float where an int goes and a numpy bool stay refused."""
    import numpy as np

    from radixserve.config import split_engine_kwargs

    kwargs = {
        "page_size": np.int64(16),
        "max_running_requests": np.int32(4),
        "mem_fraction_static": np.float32(0.5),
        "schedule_conservativeness": np.int64(1),  # an int where a float goes
    }
    configs = split_engine_kwargs(None, kwargs)
    held = {k: getattr(c, k) for c in configs for k in kwargs if hasattr(c, k)}
    assert held == {"page_size": 16, "max_running_requests": 4, "mem_fraction_static": 0.5,
                    "schedule_conservativeness": 1}  # fmt: skip
    assert [type(held[k]) for k in kwargs] == [int, int, float, int]
    with pytest.raises(TypeError, match=r"page_size \(--page-size\) must be an int; got .*16\.0"):
        split_engine_kwargs(None, {"page_size": np.float64(16.0)})
    with pytest.raises(TypeError, match=r"page_size .* must be an int"):
        split_engine_kwargs(None, {"page_size": np.bool_(True)})
