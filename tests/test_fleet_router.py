"""`radixserve fleet` as processes: its children stop with it, workers forked from the
pre-imported template, and the fleet serving through the real sglang-router (where the
`test` extra installed it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from listening_sockets import is_loopback, listening_addresses, process_tree
from native_http import get, post, run
from test_fleet import AUTH, FLEET_KEY, GREEDY, JSON, needs_router

from conftest import prompt_ids
from radixserve.fleet.probes import worker_healthy
from radixserve_bench.systems import free_port_run


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


REAPER_PROGRAM = """
import os, subprocess, sys, time
from radixserve.fleet.worker_template import OrphanReaper, become_subreaper
assert become_subreaper()
own = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])  # the fleet's own child
read, write = os.pipe()
middle = os.fork()
if middle == 0:  # a worker that dies before its child (the engine core): it is orphaned
    orphan = os.fork()
    if orphan == 0:
        time.sleep(0.5)
        os._exit(0)
    os.write(write, str(orphan).encode())
    os._exit(0)
os.waitpid(middle, 0)
orphan = int(os.read(read, 32))
parent = open(f"/proc/{orphan}/stat").read().rsplit(")", 1)[1].split()[1]
time.sleep(1.0)  # both exited: zombies, children of this subreaper
reaper = OrphanReaper(lambda: [own.pid], interval_s=0.2)
first = reaper.tick(10.0)  # the first look only notes them
second = reaper.tick(10.5)
print(parent == str(os.getpid()), first, second == [orphan], os.path.exists(f"/proc/{orphan}"))
print(own.poll())  # the fleet's own child was left to its Popen: its exit code is intact
"""


def test_orphans_adopted_by_the_fleet_are_reaped_and_its_own_children_left_alone():
    done = subprocess.run(
        [sys.executable, "-c", REAPER_PROGRAM], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True [] True False", "3"]


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
        # the router's metrics port: 29000 unless told, and another router (a test on the
        # other xdist worker) may hold that one
        command += ["--router-prometheus-port", str(free_port_run(1))]
        self._launch(command, cwd=cwd, env=env)

    def _launch(
        self, command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        """Runs `command` (a `radixserve fleet`) and returns once it is ready; its output
        goes on into `self.log`."""
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
