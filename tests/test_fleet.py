"""`radixserve fleet` and the HTTP contract sglang-router relies on.

The router re-serializes every body it forwards (unknown fields dropped, its own defaults
written in); the bodies below are what sglang-router 0.3 sends, captured from the wire. The
tests through the real router run where `sglang-router` is installed (the `test` extra)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from native_http import get, post, run

from conftest import prompt_ids
from radixserve.cli import build_parser, engine_args_from, main, server_config_from
from radixserve.cli_args import dataclass_flags
from radixserve.config import CacheConfig, FleetConfig, LoadConfig, SchedulerConfig, ServerConfig
from radixserve.fleet.launch import fleet_children, worker_children
from radixserve.fleet.router import router_command

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ROUTER_GENERATE_DEFAULTS = {
    "model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False,
    "return_bytes": False, "return_entropy": False,
}  # fmt: skip
ROUTER_CHAT_DEFAULTS = {
    "logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False,
}  # fmt: skip
ROUTER_COMPLETION_DEFAULTS = {
    "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
    "skip_special_tokens": True, "return_hidden_states": False,
}  # fmt: skip
JSON = {"Content-Type": "application/json"}  # the router answers 415 without it
FLEET_KEY = "fleet-key-5b7c91"
AUTH = JSON | {"Authorization": f"Bearer {FLEET_KEY}"}
HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
needs_router = pytest.mark.skipif(
    not HAS_ROUTER, reason="sglang-router is not installed (pip install 'radixserve[fleet]')"
)


# ---- the router's bodies, sent straight to one worker --------------------------------------


def test_generate_accepts_the_routers_defaults(server):
    body = ROUTER_GENERATE_DEFAULTS | {"input_ids": prompt_ids(3), "sampling_params": GREEDY}
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 8
    for value in ("yes", 1):
        status, out = run(post(server.url + "/generate", body | {"log_metrics": value}))
        assert status == 400 and out["error"]["param"] == "log_metrics"
    # SGLang's data-parallel routing key and log opt-out change nothing on one worker
    sglang_extras = {"routing_key": "session-7", "no_logs": True}
    status, out = run(post(server.url + "/generate", body | sglang_extras))
    assert status == 200 and len(out["output_ids"]) == 8
    for key, wrong in (("routing_key", 7), ("no_logs", "yes")):
        status, out = run(post(server.url + "/generate", body | {key: wrong}))
        assert status == 400 and out["error"]["param"] == key


def test_openai_routes_accept_the_routers_defaults(server):
    messages = [{"role": "user", "content": "hi"}]
    chat = ROUTER_CHAT_DEFAULTS | {"model": "tiny", "messages": messages}
    status, out = run(
        post(server.url + "/v1/chat/completions", chat | {"max_completion_tokens": 4})
    )
    assert status == 200 and out["usage"]["completion_tokens"] <= 4
    status, out = run(post(server.url + "/v1/chat/completions", chat | {"separate_reasoning": 1}))
    assert status == 400 and out["error"]["param"] == "separate_reasoning"
    completion = ROUTER_COMPLETION_DEFAULTS | {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    status, out = run(post(server.url + "/v1/completions", completion))
    assert status == 200 and out["usage"]["completion_tokens"] <= 4


def test_server_info_names_model_and_tokenizer_paths(server):
    status, info = run(get(server.url + "/server_info"))
    assert status == 200 and info["model_path"] and info["tokenizer_path"]


# ---- the fleet command -------------------------------------------------------------------


def test_dataclass_flags_round_trip_through_the_serve_parser(tiny_chat_model):
    argv = ["serve", tiny_chat_model, "--page-size", "8", "--disable-radix-cache"]
    argv += ["--max-total-tokens", "4096", "--served-model-name", "x", "--log-level", "info"]
    args = build_parser().parse_args(argv)
    engine_args, server = engine_args_from(args), server_config_from(args)
    assert engine_args["model"] == tiny_chat_model and engine_args["page_size"] == 8
    flags = [
        f
        for cls in (LoadConfig, CacheConfig, SchedulerConfig)
        for f in dataclass_flags(engine_args, cls)
    ]
    flags += dataclass_flags(vars(server), ServerConfig)
    again = build_parser().parse_args(["serve", *flags])
    assert engine_args_from(again) == engine_args and server_config_from(again) == server


def test_workers_get_their_own_port_cores_and_one_thread(tiny_chat_model):
    config = FleetConfig(workers=3, worker_base_port=40100)
    server = ServerConfig(host="0.0.0.0", port=1, api_key="k", served_model_name="tiny")
    engine_args = {"model": tiny_chat_model, "device": "cpu", "page_size": 8}
    workers = worker_children(config, server, engine_args)
    allowed = sorted(os.sched_getaffinity(0))
    for i, worker in enumerate(workers):
        command = worker.command
        assert command[command.index("--port") + 1] == str(40100 + i)
        assert command[command.index("--host") + 1] == "127.0.0.1"  # loopback, whatever --host
        assert "--api-key" not in command and "--page-size" in command
        assert worker.cores == [allowed[i % len(allowed)]]
        assert worker.env["OMP_NUM_THREADS"] == "1"


def test_cuda_workers_get_one_visible_gpu_each(monkeypatch, tiny_chat_model):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    config = FleetConfig(workers=2, base_gpu_id=1)
    workers = worker_children(config, ServerConfig(), {"model": tiny_chat_model, "device": "cuda"})
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["5", "6"]
    assert all(w.cores is None and "cuda" in w.command for w in workers)
    with pytest.raises(ValueError, match="--base-gpu-id 2 needs 4 GPUs; 3 visible"):
        worker_children(FleetConfig(workers=2, base_gpu_id=2), ServerConfig(), {"device": "cuda"})


def test_pd_fleet_workers_get_their_mode_bootstrap_port_and_one_thread(tiny_chat_model):
    argv = ["fleet", tiny_chat_model, "--prefill-workers", "2", "--decode-workers", "1"]
    argv += ["--worker-base-port", "40100", "--disaggregation-bootstrap-port", "41000"]
    argv += ["--disaggregation-transfer-timeout", "7", "--page-size", "8"]
    args = build_parser().parse_args(argv)
    config = FleetConfig(**{n: getattr(args, n) for n in ("prefill_workers", "decode_workers")})
    config.worker_base_port = 40100
    engine_args = engine_args_from(args) | {"device": "cpu"}
    assert "disaggregation_mode" not in engine_args  # the fleet sets it per worker
    workers, router = fleet_children(config, server_config_from(args), engine_args)
    modes = [w.command[w.command.index("--disaggregation-mode") + 1] for w in workers]
    assert modes == ["prefill", "prefill", "decode"]
    allowed = sorted(os.sched_getaffinity(0))
    for i, worker in enumerate(workers):
        command = worker.command
        assert command[command.index("--port") + 1] == str(40100 + i)
        assert command[command.index("--disaggregation-transfer-timeout") + 1] == "7.0"
        assert worker.cores == [allowed[i % len(allowed)]]
        assert worker.env["OMP_NUM_THREADS"] == "1"
    ports = [w.command[w.command.index("--disaggregation-bootstrap-port") + 1] for w in workers]
    assert ports == ["41000", "41001", "41000"]  # the decode worker's is unused
    assert [w.bootstrap_port for w in workers] == [41000, 41001, None]
    pd = router.command[router.command.index("--pd-disaggregation") :]
    assert pd[: pd.index("--policy")] == [
        "--pd-disaggregation",
        *("--prefill", workers[0].url, "41000", "--prefill", workers[1].url, "41001"),
        *("--decode", workers[2].url),
    ]
    assert "--worker-urls" not in router.command
    with pytest.raises(SystemExit):  # per worker, not a fleet flag
        build_parser().parse_args([*argv, "--disaggregation-mode", "prefill"])


def test_pd_fleet_needs_both_roles_and_a_fixed_bootstrap_port(tiny_chat_model):
    with pytest.raises(ValueError, match="--prefill-workers and --decode-workers go together"):
        FleetConfig(prefill_workers=1)
    config = FleetConfig(prefill_workers=1, decode_workers=1)
    engine_args = {"model": tiny_chat_model, "device": "cpu", "disaggregation_bootstrap_port": 0}
    with pytest.raises(ValueError, match="--disaggregation-bootstrap-port must be a fixed port"):
        worker_children(config, ServerConfig(), engine_args)
    with pytest.raises(SystemExit, match="--decode-workers"):
        main(["fleet", tiny_chat_model, "--decode-workers", "2"])


def test_colliding_fleet_ports_are_refused_naming_both_owners(tiny_chat_model):
    config = FleetConfig(prefill_workers=2, decode_workers=1)
    config.worker_base_port = 40200
    engine_args = {"model": tiny_chat_model, "device": "cpu"}
    clash = engine_args | {"disaggregation_bootstrap_port": 40201}  # prefill 0's = worker 1's
    with pytest.raises(
        ValueError,
        match="40201 is both prefill worker 0's --disag.* and prefill worker 1's HTTP port",
    ):
        fleet_children(config, ServerConfig(), clash)
    config.router_port = 40202  # the decode worker's HTTP port
    with pytest.raises(ValueError, match=r"port 40202 is both the router \(--router-port\)"):
        fleet_children(
            config, ServerConfig(), engine_args | {"disaggregation_bootstrap_port": 41000}
        )
    config.router_port, config.router_prometheus_port = 40300, 40200  # worker 0's HTTP port
    with pytest.raises(ValueError, match=r"40200 is both the router's metrics .* worker 0"):
        fleet_children(
            config, ServerConfig(), engine_args | {"disaggregation_bootstrap_port": 41000}
        )


def test_router_command_maps_log_level_and_lets_extra_args_override():
    command = router_command(
        ["http://a"], "h", 1, "round_robin", log_level="warning", extra_args="--policy random",
        prometheus_port=29123,
    )  # fmt: skip
    assert command[command.index("--log-level") + 1] == "warn"
    assert command[command.index("--prometheus-port") + 1] == "29123"
    assert command[-2:] == ["--policy", "random"]  # the router's argparse: the last one wins


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", 0),
        ("policy", "best"),
        ("cpu_cores_per_worker", 0),
        ("base_gpu_id", -1),
        ("prefill_workers", -1),
        ("policy", "power_of_two"),
    ],
)
def test_fleet_config_errors_name_the_flag(field, value):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
        FleetConfig(**{field: value})


def test_power_of_two_needs_a_pd_fleet_of_two_and_two():
    FleetConfig(policy="power_of_two", prefill_workers=2, decode_workers=2)
    with pytest.raises(ValueError, match="at least 2 prefill and 2 decode"):
        FleetConfig(policy="power_of_two", prefill_workers=1, decode_workers=2)


def test_missing_router_is_a_clear_error(monkeypatch, tiny_chat_model):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sglang_router" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit, match=r"pip install 'radixserve\[fleet\]'"):
        main(["fleet", tiny_chat_model, "--workers", "1"])
