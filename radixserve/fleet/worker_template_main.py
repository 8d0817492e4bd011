"""The worker template's process (fleet/worker_template.py): imports what a worker imports,
says ready, then forks a worker for each request on its socket until the fleet closes it.

Run by the fleet only: `python -m radixserve.fleet.worker_template_main FD` (FD: its end of
the fleet's socket pair). It runs no thread and never initializes CUDA, so each fork is a
clean copy; every request is served by a double fork, so the worker is reparented to the
fleet (a child subreaper) and this process only reaps the middle one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

from radixserve.fleet.worker_template import die_with_parent

REPARENT_TIMEOUT_S = 5.0
"""How long a new worker waits to become the fleet's child (the middle process exits at once)."""


def preload() -> None:
    """What `radixserve serve` imports before its model loads, its core's modules included."""
    import radixserve.cli  # noqa: F401
    import radixserve.engine.core_process  # noqa: F401
    import radixserve.server.launch  # noqa: F401
    from radixserve.model.tokenizer import import_tokenizer_library

    import_tokenizer_library()


def main(argv: list[str]) -> int:
    die_with_parent()
    channel = socket.socket(fileno=int(argv[0]))
    file = channel.makefile("rwb")
    fleet_pid = os.getppid()
    preload()
    reply(file, {"ready": True})
    try:
        for line in file:
            try:
                pid = fork_worker(json.loads(line), fleet_pid, (file, channel))
                reply(file, {"pid": pid})
            except (OSError, ValueError, KeyError) as exc:
                reply(file, {"error": f"{type(exc).__name__}: {exc}"})
    except KeyboardInterrupt:  # Ctrl-C in the fleet's terminal: the fleet stops us
        pass
    return 0


def reply(file, message: dict) -> None:
    file.write(json.dumps(message).encode() + b"\n")
    file.flush()


def fork_worker(request: dict, fleet_pid: int, channel: tuple) -> int:
    """Double fork: the grandchild runs `radixserve <argv>`; returns its pid."""
    argv, env, cores = list(request["argv"]), dict(request["env"]), request["cores"]
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 1
        try:
            os.close(read_end)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                run_worker(argv, env, cores, fleet_pid, channel)
            os.write(write_end, str(worker).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(middle, 0)
    if not data:
        raise OSError("the worker could not be forked")
    return int(data)


def run_worker(
    argv: list[str], env: dict[str, str], cores: list[int] | None, fleet_pid: int, channel
) -> None:
    """In the forked worker: close the template's channel (file, socket), become the fleet's
    child, take its environment and cores, run the command; never returns."""
    code: int | str | None = 1
    try:
        for end in channel:
            end.close()
        if not reparented(fleet_pid):
            os._exit(1)  # the fleet is gone
        die_with_parent()
        if os.getppid() != fleet_pid:  # the fleet died before the line above
            os._exit(1)
        if cores:
            os.sched_setaffinity(0, cores)
        os.environ.update(env)
        sys.argv = ["radixserve", *argv]
        from radixserve.cli import main as radixserve_main

        code = radixserve_main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(exit_code(code))


def reparented(fleet_pid: int) -> bool:
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != fleet_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def exit_code(code: int | str | None) -> int:
    """What the interpreter would exit with for SystemExit(code); output flushed first."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code if isinstance(code, int) else 0 if code is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
