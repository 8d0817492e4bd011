"""The fleet's worker template: one process that has imported what a worker imports (torch,
transformers, radixserve's server and engine) and forks each new worker from there, so that a
worker's start is its model load, not seconds of imports (docs/performance.md, "A worker's
start"). The worker then forks its engine core too (client/core_start.py).

    fleet --socketpair (JSON lines)--> template (python -m radixserve.fleet.worker_template_main)
      {"argv", "env", "cores"} ->          fork -> fork -> worker: `radixserve <argv>`
      <- {"pid"}                           (the middle process exits at once)

The fleet is a child subreaper (Linux prctl), so the orphaned worker becomes its child: the
fleet waits for it, signals it and reads its exit code as for any other child
(`ForkedProcess`, Popen's methods that the fleet uses). A subreaper adopts every orphaned
descendant, not only workers (a worker's engine core when the worker was killed first):
`OrphanReaper` reaps those, so that no zombie outlives its second look. The keys a worker
gets travel on the socket pair, never in an exec-time environment, so its /proc/PID/environ
(the template's) holds none. CPU fleets on Linux only: a GPU worker's CUDA_VISIBLE_DEVICES
must be read by a fresh process (--no-worker-template, or any GPU fleet, starts every worker
with exec).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from radixserve.client.core_start import CORE_ENV_DEFAULTS

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36
WORKER_COMMAND = [sys.executable, "-m", "radixserve.cli"]
"""The start of the command lines the template can run (what follows is `radixserve`'s argv)."""
READY_TIMEOUT_S = 600.0
"""How long the first worker waits for the template's imports."""
POLL_S = 0.05


class TemplateError(RuntimeError):
    """The template could not start a worker (it is gone, or said why)."""


class ForkedProcess:
    """A worker forked by the template and reparented to this process: Popen's poll, wait,
    send_signal, terminate, kill, pid and returncode."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WorkerTemplate:
    """The template process and the fleet's end of its socket pair."""

    def __init__(self, env: dict[str, str]):
        """Starts the template with `env` (what every worker shares: its torch threads)
        added; OpenMP's CORE_ENV_DEFAULTS too, which it reads once, when torch loads."""
        own, theirs = socket.socketpair()
        full_env = CORE_ENV_DEFAULTS | os.environ | env
        command = [sys.executable, "-m", "radixserve.fleet.worker_template_main"]
        self.proc = subprocess.Popen(
            [*command, str(theirs.fileno())],
            env=full_env,
            pass_fds=(theirs.fileno(),),
            preexec_fn=die_with_parent,
        )
        theirs.close()
        self._file = own.makefile("rwb")
        self._socket = own
        self._ready = False
        self._lock = threading.Lock()  # one request on the socket at a time

    @staticmethod
    def can_run(command: list[str]) -> bool:
        return command[: len(WORKER_COMMAND)] == WORKER_COMMAND

    def start(
        self, command: list[str], env: dict[str, str], cores: list[int] | None
    ) -> ForkedProcess:
        """Forks a worker running `command` with `env` added, pinned to `cores`."""
        argv = command[len(WORKER_COMMAND) :]
        with self._lock:
            self._wait_ready()
            reply = self._call({"argv": argv, "env": env, "cores": cores})
        if "pid" not in reply:
            raise TemplateError(f"the worker template refused: {reply.get('error')}")
        return ForkedProcess(int(reply["pid"]), command)

    def close(self) -> None:
        self._file.close()
        self._socket.close()  # the template exits at end of input
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _wait_ready(self) -> None:
        if not self._ready:
            self._socket.settimeout(READY_TIMEOUT_S)
            if self._read() != {"ready": True}:
                raise TemplateError("the worker template did not start")
            self._ready = True

    def _call(self, request: dict) -> dict:
        try:
            self._file.write(json.dumps(request).encode() + b"\n")
            self._file.flush()
        except OSError as exc:
            raise TemplateError(f"the worker template is gone: {exc}") from None
        return self._read()

    def _read(self) -> dict:
        try:
            line = self._file.readline()
        except OSError as exc:
            raise TemplateError(f"the worker template is gone: {exc}") from None
        if not line:
            raise TemplateError(f"the worker template exited (code {self.proc.poll()})")
        return json.loads(line)


def fork_from_template(workers: list, env: dict[str, str]) -> WorkerTemplate | None:
    """Starts a template for `workers` (fleet Children) and has each start from it; None (and
    each starts with exec) on GPUs or where this process cannot adopt orphans."""
    if any("CUDA_VISIBLE_DEVICES" in worker.env for worker in workers):
        return None
    if not become_subreaper():
        return None
    template = WorkerTemplate(env)
    for worker in workers:
        worker.template = template
    return template


def become_subreaper() -> bool:
    """Makes this process adopt its orphaned descendants (the template's workers); False
    where it cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent() -> None:
    """On Linux, this process gets SIGTERM when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class OrphanReaper:
    """Reaps the exited children this process did not start: descendants it adopted as a
    subreaper. `own()`: the pids it waits for itself (workers, router, template), never
    touched. A zombie is reaped on its second look, `interval_s` or more after the first,
    so that a child that some other code waits for at once is never taken from it."""

    def __init__(self, own: Callable[[], Iterable[int]], interval_s: float = 1.0):
        self.own, self.interval_s = own, interval_s
        self._seen: set[int] = set()  # zombies at the last look
        self._last = 0.0

    def tick(self, now: float) -> list[int]:
        """Looks at most once per interval; returns the pids it reaped."""
        if now - self._last < self.interval_s:
            return []
        self._last = now
        zombies = {pid for pid in child_pids() if is_zombie(pid)} - set(self.own())
        reaped = []
        for pid in zombies & self._seen:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if done:
                reaped.append(pid)
        if reaped:
            logger.info("reaped %d orphaned process(es): %s", len(reaped), sorted(reaped))
        self._seen = zombies - set(reaped)
        return reaped


def own_pids(procs: Iterable, template: WorkerTemplate | None) -> list[int]:
    """The pids the fleet waits for itself: its children's (`procs`, None where not started)
    and the template's."""
    pids = [proc.pid for proc in procs if proc is not None]
    return pids + ([template.proc.pid] if template is not None else [])


def child_pids() -> set[int]:
    """This process's children (of all its threads; empty where /proc does not list them)."""
    pids: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as file:
                pids.update(int(pid) for pid in file.read().split())
        except OSError:
            continue
    return pids


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
