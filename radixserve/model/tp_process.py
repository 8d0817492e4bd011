"""RankProcess: one tensor-parallel rank > 0 as `python -m radixserve.model.tp_worker`.

    rank 0                                          rank r (its own interpreter)
      socketpair: one end inherited by rank r  --->  Connection(fd): RankSpec in
      stderr: a pipe, each line copied to ours  <---  logs, tracebacks (the last lines kept)

A module entry point, not multiprocessing's spawn: nothing re-imports the caller's
`__main__`, so an engine started from `python -`, a notebook or an unguarded script starts
its ranks the same way. The channel is a socket pair inherited by the child alone: nothing
listens, so nothing else can connect to it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

import radixserve

TAIL_LINES = 20
"""Lines of a rank's stderr kept for the error that names it."""
PACKAGE_ROOT = str(Path(radixserve.__file__).resolve().parents[1])
"""The folder holding this radixserve: the rank imports the same code as rank 0."""


class RankProcess:
    """A started rank: `conn` to it, liveness, exit code and its last lines of output."""

    def __init__(self, rank: int):
        self.rank = rank
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "radixserve.model.tp_worker"]
        command += ["--rank", str(rank), "--fd", str(theirs.fileno())]
        try:
            self._proc = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=_rank_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._copier = threading.Thread(
            target=self._copy_stderr, name=f"radixserve-tp{rank}-stderr", daemon=True
        )
        self._copier.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def join(self, timeout_s: float | None = None) -> None:
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return
        self._copier.join(1.0)  # its last lines are read before they are reported

    def terminate(self) -> None:
        if self.is_alive():
            self._proc.kill()
        self._proc.wait()
        self._copier.join(1.0)

    def last_output(self) -> str:
        """The last TAIL_LINES lines the rank wrote to stderr."""
        return "".join(self._tail).rstrip()

    def _copy_stderr(self) -> None:
        for raw in self._proc.stderr:
            line = raw.decode(errors="replace")
            self._tail.append(line)
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # ours closed: keep the tail anyway
                pass


def _rank_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [PACKAGE_ROOT, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
