"""The ranks a node starts on its own machine, as RankProcesses (model/tp_process.py): start
them, wait until each says hello / ready, stop them. Node 0's TPModelRunner and a remote node
(model/tp_node.py) drive their local ranks with these.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from radixserve.distributed.group import RankFailedError
from radixserve.model.tp_process import RankProcess
from radixserve.model.tp_worker import RankSpec

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not exited by then is terminated
FAILED_START_JOIN_S = 2.0  # the same after a failed start (a silent rank reads nothing)


@dataclass
class LocalRank:
    """A rank started on this machine, its pipe, and what it reported before it died."""

    rank: int
    process: RankProcess
    conn: Connection
    error: str | None = None

    def poll_error(self) -> str | None:
        try:
            while self.conn.poll(0):
                kind, message = self.conn.recv()
                if kind == "error":
                    self.error = message
        except (EOFError, OSError):
            pass
        return self.error

    def describe_exit(self) -> str:
        """`rank r exited (code c): <its error>`, then its last output, if any."""
        text = f"rank {self.rank} exited (code {self.process.exitcode})"
        if self.poll_error():
            text += f": {self.error}"
        output = self.process.last_output()
        return text + (f"; its last output:\n{output}" if output else "")


def spawn_rank(rank: int, spec: RankSpec) -> LocalRank:
    process = RankProcess(rank)
    process.conn.send(spec)
    return LocalRank(rank=rank, process=process, conn=process.conn)


def wait_for(workers: list[LocalRank], kind: str, deadline: float) -> None:
    """Waits until every rank has sent `kind` ("hello", "ready"); RankFailedError naming the
    first rank that reports an error, exits or is still silent at `deadline`."""
    for w in workers:
        while not w.conn.poll(0.1):
            if not w.process.is_alive():
                w.process.join(1.0)
                raise RankFailedError(f"tensor-parallel start failed: {w.describe_exit()}")
            if time.monotonic() > deadline:
                output = w.process.last_output() or "(none)"
                raise RankFailedError(
                    f"tensor-parallel start failed: rank {w.rank} did not report {kind} within "
                    f"--dist-timeout; its last output:\n{output}"
                )
        try:
            got, message = w.conn.recv()
        except (EOFError, OSError):
            got, message = "error", "its channel closed"
        if got != kind:
            w.error = message
            w.process.join(JOIN_TIMEOUT_S)
            raise RankFailedError(f"tensor-parallel start failed: {w.describe_exit()}")


def failed_start(workers: list[LocalRank], exc: BaseException) -> BaseException:
    """Stops `workers` after a failed start; the error to raise, naming the ranks that died."""
    failed = [w for w in workers if w.poll_error() or not w.process.is_alive()]
    stop_ranks(workers, FAILED_START_JOIN_S)
    if isinstance(exc, RankFailedError):
        return exc
    reasons = [w.describe_exit() for w in failed]
    if reasons:
        error = RankFailedError("tensor-parallel start failed: " + "; ".join(reasons))
        error.__cause__ = exc
        return error
    return exc


def send_header(workers: list[LocalRank], header: tuple | None) -> None:
    """Wakes every local rank for the next step (None: tells it to stop)."""
    for w in workers:
        w.conn.send(header)


def stop_ranks(workers: list[LocalRank], join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    for w in workers:
        w.process.join(join_timeout_s)
        if w.process.is_alive():
            logger.warning("tensor-parallel rank %d did not stop; terminating it", w.rank)
            w.process.terminate()
            w.process.join()
