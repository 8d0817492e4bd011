"""`radixserve fleet` and the HTTP contract sglang-router relies on.

The router re-serializes every body it forwards (unknown fields dropped, its own defaults
written in); the bodies below are what sglang-router 0.3 sends, captured from the wire. The
tests through the real router run where `sglang-router` is installed (the `test` extra)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from listening_sockets import is_loopback, listening_addresses, process_tree
from test_server_native import get, post, run

from conftest import prompt_ids
from radixserve.cli import build_parser, engine_args_from, main, server_config_from
from radixserve.cli_args import dataclass_flags
from radixserve.config import CacheConfig, FleetConfig, LoadConfig, SchedulerConfig, ServerConfig
from radixserve.fleet.launch import fleet_children, worker_children
from radixserve.fleet.probes import worker_healthy
from radixserve.fleet.router import router_command
from radixserve_bench.systems import free_port_run

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


def test_router_command_maps_log_level_and_lets_extra_args_override():
    command = router_command(
        ["http://a"], "h", 1, "round_robin", log_level="warning", extra_args="--policy random"
    )
    assert command[command.index("--log-level") + 1] == "warn"
    assert command[-2:] == ["--policy", "random"]  # the router's argparse: the last one wins


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", 0),
        ("policy", "best"),
        ("cpu_cores_per_worker", 0),
        ("base_gpu_id", -1),
        ("prefill_workers", -1),
    ],
)
def test_fleet_config_errors_name_the_flag(field, value):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
        FleetConfig(**{field: value})


def test_missing_router_is_a_clear_error(monkeypatch, tiny_chat_model):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sglang_router" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit, match=r"pip install 'radixserve\[fleet\]'"):
        main(["fleet", tiny_chat_model, "--workers", "1"])


def test_children_stop_when_the_fleet_is_killed():
    program = (
        "import time; from radixserve.fleet.launch import Child; "
        "c = Child('x', ['sleep', '60'], ''); c.start(); print(c.proc.pid, flush=True); "
        "time.sleep(60)"
    )
    fleet = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    child = int(fleet.stdout.readline())
    fleet.kill()  # SIGKILL: no handler of ours runs
    fleet.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.1)
    assert not _running(child)


def test_template_workers_stop_when_the_fleet_is_killed(tiny_chat_model):
    """A worker forked from the template is the fleet's child (a subreaper's orphan): it
    serves, and it and the template go when the fleet is SIGKILLed."""
    port = free_port_run(1)
    program = (
        "import sys, time; from radixserve.fleet.launch import Child; "
        "from radixserve.fleet.worker_template import fork_from_template; "
        f"c = Child('x', [sys.executable, '-m', 'radixserve.cli', 'serve', {tiny_chat_model!r}, "
        f"'--port', '{port}'], ''); t = fork_from_template([c], {{}}); c.start(); "
        "print(c.proc.pid, t.proc.pid, flush=True); time.sleep(600)"
    )
    fleet = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    worker, template = map(int, fleet.stdout.readline().split())
    try:
        assert parent_pid(worker) == fleet.pid
        deadline = time.monotonic() + 300
        while not worker_healthy(f"http://127.0.0.1:{port}"):
            assert time.monotonic() < deadline and _running(worker)
            time.sleep(0.5)
    finally:
        fleet.kill()  # SIGKILL: no handler of ours runs
        fleet.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_running(worker) or _running(template)):
        time.sleep(0.2)
    assert not _running(worker) and not _running(template)


def _running(pid: int) -> bool:
    """Whether `pid` is alive (reaped or a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# ---- through the real router -------------------------------------------------------------


class FleetProcess:
    """`radixserve fleet` in a subprocess, one torch thread per worker; `url`: the router,
    `worker_urls`: the workers. `cwd`: the folder it runs in (None: this one); `env`: added
    to its environment."""

    def __init__(
        self,
        model: str,
        workers: int,
        *flags: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        router_port, base = free_port_run(1), free_port_run(workers)
        self.url = f"http://127.0.0.1:{router_port}"
        self.worker_urls = [f"http://127.0.0.1:{base + i}" for i in range(workers)]
        command = [sys.executable, "-m", "radixserve.cli", "fleet", model]
        command += ["--workers", str(workers), "--router-port", str(router_port)]
        command += ["--worker-base-port", str(base), "--max-total-tokens", "16384", *flags]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=os.environ | (env or {}),
        )
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if "fleet ready at" in line:
                break
        else:
            raise RuntimeError("fleet did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def children(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        )
        return [int(pid) for pid in out.stdout.split()]

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@needs_router
def test_fleet_behind_the_real_router(tiny_chat_model, server, tmp_path):
    env = {"RADIXSERVE_API_KEY": FLEET_KEY}  # the key: never on a command line
    fleet = FleetProcess(tiny_chat_model, 2, "--served-model-name", "tiny", cwd=tmp_path, env=env)
    children = fleet.children()
    try:
        assert len(children) == 4  # two workers, the router and the worker template
        for pid in [fleet.proc.pid, *children]:
            assert FLEET_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert_workers_forked_from_the_template(fleet, children)
        status, _ = run(post(fleet.url + "/generate", {"text": "hi"}, headers=JSON))
        assert status == 401  # the router holds the key
        for url in fleet.worker_urls:  # and the workers too, on loopback
            assert run(post(url + "/generate", {"text": "hi"}, headers=JSON))[0] == 401
        body = {"input_ids": prompt_ids(5), "sampling_params": GREEDY, "rid": "r1"}
        status, routed = run(post(fleet.url + "/generate", body, headers=AUTH))
        assert status == 200 and routed["meta_info"]["id"] == "r1"
        _, direct = run(post(server.url + "/generate", body | {"rid": None}))
        assert routed["output_ids"] == direct["output_ids"]  # same greedy tokens as one worker
        status, sse = run(post(fleet.url + "/generate", body | {"stream": True}, headers=AUTH))
        assert status == 200 and sse.rstrip().endswith("data: [DONE]")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, out = run(post(fleet.url + "/v1/chat/completions", chat, headers=AUTH))
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"
        status, models = run(get(fleet.url + "/v1/models", headers=AUTH))
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
        status, flushed = run(post(fleet.url + "/flush_cache", {}, headers=AUTH))
        assert status == 200 and flushed["workers_flushed"] == 2
        status, info = run(get(fleet.url + "/get_model_info", headers=AUTH))
        assert status == 200 and info["model_path"] == tiny_chat_model
        assert run(get(fleet.url + "/health"))[0] == 200
        assert_listening_on_loopback_only(fleet.proc.pid)
    finally:
        assert fleet.stop() == 0, "".join(fleet.log[-30:])
    time.sleep(0.5)
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every worker and the router stopped with the fleet
    assert list(tmp_path.iterdir()) == []  # no pid, log or other run file left where it ran


def assert_workers_forked_from_the_template(fleet: FleetProcess, children: list[int]) -> None:
    """Each worker was forked from the fleet's pre-imported template (it has the template's
    command line: never exec'd) and forked its core in turn; neither imported torch,
    transformers or the engine again. The key reached them on the template's socket pair, so
    no exec-time environment under the fleet holds it (but the router's, which it is for)."""
    workers = []
    for url in fleet.worker_urls:
        status, info = run(get(url + "/server_info", headers=AUTH))
        assert status == 200
        start = info["engine"]["core_start"]
        assert start["start_method"] == "fork" and start["heavy_modules_imported"] == []
        workers.append(parent_pid(info["engine"]["pid"]))  # the core's parent: the worker
        assert FLEET_KEY.encode() not in environ(info["engine"]["pid"])
    template = [p for p in children if p not in workers and b"worker_template_main" in cmdline(p)]
    assert len(template) == 1 and set(workers) < set(children)
    for pid in [*workers, template[0]]:
        assert cmdline(pid) == cmdline(template[0]) and FLEET_KEY.encode() not in environ(pid)


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def assert_listening_on_loopback_only(pid: int) -> None:
    """What `ss -ltnp` would show for the fleet and every process under it: loopback only."""
    addresses = {address for p in process_tree(pid) for address in listening_addresses(p)}
    assert addresses and all(is_loopback(host) for host, _ in addresses), addresses


@needs_router
def test_pd_fleet_behind_the_real_router(tiny_chat_model, server):
    bootstrap = str(free_port_run(1))
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--page-size", "16"]
    flags += ["--disaggregation-bootstrap-port", bootstrap, "--policy", "round_robin"]
    fleet = FleetProcess(tiny_chat_model, 2, *flags)
    children = fleet.children()
    try:
        assert len(children) == 4  # a prefill and a decode worker, the router, the template
        assert "1 prefill + 1 decode workers" in "".join(fleet.log)
        body = {"input_ids": prompt_ids(9, 40), "sampling_params": GREEDY}
        status, routed = run(post(fleet.url + "/generate", body, headers=JSON))
        assert status == 200, routed
        _, single = run(post(server.url + "/generate", body))
        assert routed["output_ids"] == single["output_ids"]  # same greedy tokens as one worker
        assert routed["meta_info"]["cached_tokens"] == 32  # the prompt's KV came from prefill
        for url in fleet.worker_urls:  # a keyless router's clients send no key: user routes
            assert run(get(url + "/v1/models"))[0] == 200  # open as the router's, no more:
            assert run(post(url + "/flush_cache", {}, headers=JSON))[0] == 401  # admin: keyed
        assert_listening_on_loopback_only(fleet.proc.pid)  # the bootstrap port included
    finally:
        assert fleet.stop() == 0, "".join(fleet.log[-30:])
    time.sleep(0.5)
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # both workers and the router stopped with the fleet
