"""Starts N workers and the router, supervises them, stops them all on SIGTERM / SIGINT.

    radixserve fleet --workers N
        worker i: radixserve serve --host 127.0.0.1 --port (worker_base_port + i)
                  CPU: pinned to its own cores, that many torch threads; CUDA: one GPU each
        router:   sglang-router (on --host, --router-port); each worker registered through its
                  POST /workers with the workers' key (fleet/auth.py)

    radixserve fleet --prefill-workers P --decode-workers D       (prefill/decode disaggregation)
        workers 0..P-1:   ... --disaggregation-mode prefill
                              --disaggregation-bootstrap-port (disaggregation_bootstrap_port + i)
        workers P..P+D-1: ... --disaggregation-mode decode
        router:   ... --pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...

A worker that dies is left to the router's health checks and circuit breaker (its traffic
moves to the others); the fleet stops when the router dies or no worker is left.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from radixserve.cli_args import dataclass_flags
from radixserve.config import (
    SGLANG_BOOTSTRAP_PORT,
    CacheConfig,
    DisaggregationConfig,
    FleetConfig,
    HiCacheConfig,
    LoadConfig,
    LoraConfig,
    SchedulerConfig,
    ServerConfig,
    split_engine_kwargs,
)
from radixserve.config.server import MAX_PORT
from radixserve.fleet.auth import FleetKeys, fleet_keys, pd_secret_file, register_workers
from radixserve.fleet.kv_budget import split_cpu_kv_memory
from radixserve.fleet.probes import router_live, router_ready, worker_healthy
from radixserve.fleet.router import PDWorkers, require_router, router_command
from radixserve.fleet.worker_template import (
    ForkedProcess,
    OrphanReaper,
    TemplateError,
    WorkerTemplate,
    die_with_parent,
    fork_from_template,
    own_pids,
)

logger = logging.getLogger(__name__)
WORKER_HOST = "127.0.0.1"
POLL_S = 0.5
STOP_MARGIN_S = 15.0
"""After SIGTERM a worker drains for up to --drain-timeout (server/drain.py), then exits;
a child still running this much later is killed."""
SERVER_FLAGS_EXCLUDED = ("host", "port", "api_key", "api_key_file", "admin_api_key",
                         "admin_api_key_file", "router_url", "advertise_url")  # fmt: skip
"""Set by the fleet itself: workers listen on loopback; their key comes in the environment
(fleet/auth.py); the fleet registers them with its router."""


@dataclass
class Child:
    """One process of the fleet: a worker (with its URL) or the router."""

    name: str
    command: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    mode: str | None = None  # a PD fleet's worker: prefill | decode
    bootstrap_port: int | None = None  # a prefill worker's
    cores: list[int] | None = None
    proc: subprocess.Popen | ForkedProcess | None = None
    template: WorkerTemplate | None = None  # forks it, where the fleet has one

    def start(self) -> None:
        if self.template is not None and self.template.can_run(self.command):
            try:
                self.proc = self.template.start(self.command, self.env, self.cores)
                return
            except TemplateError as exc:
                logger.warning("%s: %s; starting it with exec", self.name, exc)
                self.template = None
        cores = self.cores
        env = os.environ | self.env
        self.proc = subprocess.Popen(self.command, env=env, preexec_fn=lambda: _setup(cores))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _setup(cores: list[int] | None) -> None:
    """In the child before exec: pin it to `cores`; on Linux, have it get SIGTERM when the
    fleet process dies, even by SIGKILL, so that no worker outlives its fleet."""
    if cores:
        os.sched_setaffinity(0, cores)
    die_with_parent()


def worker_children(
    config: FleetConfig, server: ServerConfig, engine_args: dict[str, Any]
) -> list[Child]:
    """The worker processes to start: command line, port and CPU cores or GPU of each."""
    on_cuda = split_engine_kwargs(None, engine_args)[0].torch_device().type == "cuda"
    if on_cuda:
        check_gpus(config)
        engine_args = engine_args | {"device": "cuda"}
    server_flags = dataclass_flags(asdict(server), ServerConfig, SERVER_FLAGS_EXCLUDED)
    children = []
    for i in range(config.num_workers):
        port = config.worker_base_port + i
        args = worker_engine_args(engine_args, i, config)
        flags = engine_flags(args) + server_flags
        command = [sys.executable, "-m", "radixserve.cli", "serve", *flags]
        command += ["--host", WORKER_HOST, "--port", str(port)]
        child = Child(f"worker {i}", command, f"http://{WORKER_HOST}:{port}")
        child.mode = config.worker_mode(i)
        if child.mode is not None:
            child.name = f"{child.mode} worker {i}"
        if child.mode == "prefill":
            child.bootstrap_port = args["disaggregation_bootstrap_port"]
        if on_cuda:
            child.env = {"CUDA_VISIBLE_DEVICES": visible_gpu(config.base_gpu_id + i)}
        else:
            child.cores = worker_cores(i, config.cpu_cores_per_worker)
            child.env = thread_env(config.cpu_cores_per_worker)
        children.append(child)
    return children


def worker_engine_args(
    engine_args: dict[str, Any], index: int, config: FleetConfig
) -> dict[str, Any]:
    """Worker `index`'s engine arguments: its own KV event sockets (port + index) and its own
    hierarchical cache folder (`<--hicache-dir>/worker-<index>`: a tier file is one
    process's), if any; in a PD fleet its --disaggregation-mode (prefill: a bootstrap port)."""
    if engine_args.get("hicache_dir"):
        folder = os.path.join(engine_args["hicache_dir"], f"worker-{index}")
        engine_args = engine_args | {"hicache_dir": folder}
    kv_events = CacheConfig(kv_events_config=engine_args.get("kv_events_config")).kv_events()
    if kv_events is not None:
        engine_args = engine_args | {"kv_events_config": kv_events.for_instance(index).to_json()}
    mode = config.worker_mode(index)
    if mode is None:
        return engine_args
    engine_args = engine_args | {"disaggregation_mode": mode}
    if mode == "decode":
        return engine_args
    base = engine_args.get("disaggregation_bootstrap_port", SGLANG_BOOTSTRAP_PORT)
    if base == 0 or base + index > MAX_PORT:
        raise ValueError(
            "--disaggregation-bootstrap-port must be a fixed port in a PD fleet (the router "
            f"is told each prefill worker's: that port + i, at most {MAX_PORT}); got {base}"
        )
    return engine_args | {"disaggregation_bootstrap_port": base + index}


def engine_flags(engine_args: dict[str, Any]) -> list[str]:
    classes = (LoadConfig, CacheConfig, SchedulerConfig, HiCacheConfig, DisaggregationConfig)
    classes += (LoraConfig,)
    return [flag for cls in classes for flag in dataclass_flags(engine_args, cls)]


def router_workers(workers: list[Child]) -> list[str] | PDWorkers:
    """What the router's command line names: in a PD fleet its prefill and decode workers;
    none in a data-parallel one (they register with their key once it runs)."""
    if all(w.mode is None for w in workers):
        return []
    prefill = [(w.url, w.bootstrap_port) for w in workers if w.mode == "prefill"]
    return PDWorkers(prefill, [w.url for w in workers if w.mode == "decode"])


def check_gpus(config: FleetConfig) -> None:
    available = torch.cuda.device_count()
    num, base = config.num_workers, config.base_gpu_id
    if base + num > available:
        workers = f"{num} PD workers" if config.pd_disaggregation else f"--workers {num}"
        raise ValueError(
            f"{workers} from --base-gpu-id {base} needs {base + num} GPUs; {available} visible"
        )


def visible_gpu(index: int) -> str:
    """The id of this process's `index`-th visible GPU (its CUDA_VISIBLE_DEVICES, if set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def worker_cores(index: int, per_worker: int) -> list[int]:
    """Worker `index`'s cores, in order from this process's affinity, wrapping around."""
    allowed = sorted(os.sched_getaffinity(0))
    start = index * per_worker
    return [allowed[(start + k) % len(allowed)] for k in range(per_worker)]


def thread_env(num_threads: int) -> dict[str, str]:
    """Torch (OpenMP, MKL) threads for a worker pinned to `num_threads` cores."""
    return {name: str(num_threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def run_fleet(config: FleetConfig, server: ServerConfig, engine_args: dict[str, Any]) -> int:
    """Runs the fleet until SIGTERM / SIGINT (0) or until it cannot serve any more (1)."""
    require_router()
    keys = fleet_keys(server, config.pd_disaggregation)
    engine_args = split_cpu_kv_memory(config.num_workers, engine_args)
    with pd_secret_file(config, engine_args) as engine_args:
        workers, router = fleet_children(config, server, engine_args, keys)
        env = thread_env(config.cpu_cores_per_worker)
        template = fork_from_template(workers, env) if config.worker_template else None
        stop = install_stop_signals()
        try:
            reaper = OrphanReaper(lambda: own_pids([c.proc for c in (router, *workers)], template))
            if config.autoscale:
                from radixserve.fleet.autoscale_fleet import run_autoscaled

                return run_autoscaled(config, workers, router, stop, server, reaper)
            if not start_all(workers, router, config, stop, keys):
                return 0 if stop.is_set() else 1
            print(f"radixserve fleet ready at {router.url} ({describe(config)})", flush=True)
            return supervise(workers, router, stop, reaper)
        finally:
            stop_all([router, *workers], server.drain_timeout + STOP_MARGIN_S)
            if template is not None:
                template.close()


def fleet_children(
    config: FleetConfig,
    server: ServerConfig,
    engine_args: dict[str, Any],
    keys: FleetKeys | None = None,
) -> tuple[list[Child], Child]:
    """The fleet's processes, not started yet: its workers, and the router fronting them;
    each with its key in its environment (`keys`, default: fleet_keys)."""
    keys = keys or fleet_keys(server, config.pd_disaggregation)
    workers = worker_children(config, server, engine_args)
    check_ports(workers, config.router_port, config.router_prometheus_port)
    for worker in workers:
        worker.env = worker.env | keys.worker_env()
    command = router_command(
        router_workers(workers),
        server.host,
        config.router_port,
        config.policy,
        log_level=server.log_level,
        extra_args=config.router_args,
        prometheus_port=config.router_prometheus_port,
    )
    url = f"http://{server.host}:{config.router_port}"
    return workers, Child("router", command, url, env=keys.router_env())


def check_ports(workers: list[Child], router_port: int, metrics_port: int) -> None:
    """Raises ValueError naming the flags when two of the fleet's fixed ports are the same
    (router, its metrics, worker HTTP = --worker-base-port + i, prefill bootstrap =
    --disaggregation-bootstrap-port + i): the second process would fail to bind."""
    uses = [(router_port, "the router (--router-port)"),
            (metrics_port, "the router's metrics (--router-prometheus-port)")]  # fmt: skip
    for w in workers:
        uses.append(
            (int(w.url.rsplit(":", 1)[1]), f"{w.name}'s HTTP port (--worker-base-port + i)")
        )
        if w.bootstrap_port is not None:
            uses.append((w.bootstrap_port, f"{w.name}'s --disaggregation-bootstrap-port + i"))
    owners: dict[int, str] = {}
    for port, owner in uses:
        if port in owners:
            raise ValueError(f"port {port} is both {owners[port]} and {owner}; move one")
        owners[port] = owner


def describe(config: FleetConfig) -> str:
    if config.pd_disaggregation:
        workers = f"{config.prefill_workers} prefill + {config.decode_workers} decode workers"
    else:
        workers = f"{config.num_workers} workers"
    return f"{workers}, policy {config.policy}"


def install_stop_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def start_all(
    workers: list[Child], router: Child, config: FleetConfig, stop, keys: FleetKeys
) -> bool:
    """Starts the workers, waits until each is healthy, then the router (registering the
    data-parallel workers with it) until it sees them all; False (with the reason logged)
    when one fails or a stop signal comes first."""
    deadline = time.monotonic() + config.startup_timeout_s
    for worker in workers:
        worker.start()
    for worker in workers:
        if not wait_until(worker, lambda w=worker: worker_healthy(w.url), deadline, stop):
            return False
    router.start()
    if not config.pd_disaggregation:
        if not wait_until(router, lambda: router_live(router.url), deadline, stop):
            return False
        if not register_workers(router.url, [w.url for w in workers], keys):
            return False
    return wait_until(router, lambda: router_ready(router.url, len(workers)), deadline, stop)


def wait_until(child: Child, ready, deadline: float, stop: threading.Event) -> bool:
    while not ready():
        if not child.alive:
            logger.error("%s exited with code %s while starting", child.name, child.proc.returncode)
            return False
        if time.monotonic() > deadline:
            logger.error("%s not ready after --startup-timeout-s", child.name)
            return False
        if stop.wait(POLL_S):
            return False
    return True


def supervise(
    workers: list[Child], router: Child, stop: threading.Event, reaper: OrphanReaper
) -> int:
    """Waits for a stop signal; a worker's exit is logged (the router routes around it)."""
    reported: set[str] = set()
    while not stop.wait(POLL_S):
        reaper.tick(time.monotonic())
        if not router.alive:
            logger.error("the router exited with code %s; stopping", router.proc.returncode)
            return 1
        for worker in workers:
            if not worker.alive and worker.name not in reported:
                reported.add(worker.name)
                logger.error("%s exited with code %s", worker.name, worker.proc.returncode)
        if len(reported) == len(workers):
            logger.error("no worker left; stopping")
            return 1
    return 0


def stop_all(
    children: list[Child], timeout_s: float = ServerConfig.drain_timeout + STOP_MARGIN_S
) -> None:
    """SIGTERM to every child at once (workers drain in parallel), then waits; kills any that
    outlive `timeout_s`."""
    running = [c for c in children if c.alive]
    for child in running:
        child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in running:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("%s did not stop in %.0f s; killing it", child.name, timeout_s)
            child.proc.kill()
            child.proc.wait()
