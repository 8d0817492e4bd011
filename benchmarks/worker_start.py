"""A worker's start: `radixserve serve` from launch to /health 200, wall and CPU per process.

Each round starts one `radixserve serve` (one torch thread, loopback, a free port), polls
/health every POLL_S until it answers 200, then reads every process of the worker (the HTTP
process and its descendants: the engine core, multiprocessing's helpers) with psutil: CPU
seconds (user + system) each, the core named by the pid /server_info reports. Variants
(--variant NAME=PATH[:MODE], PATH the checkout put on PYTHONPATH) alternate round by round,
so a before/after pair sees the same machine load. MODE: `exec` (a plain `radixserve serve`),
`fork-env` (the same with OpenMP's variables set at exec, as fleet workers have them: a
checkout that can fork its core does), `template` (forked from a worker template started
once beforehand, as `radixserve fleet` starts its workers; its own imports are not counted).
--importtime adds `python -X importtime` of what each process imports (the HTTP process:
radixserve.server.launch; a spawned core: radixserve.engine.core_process).

Run:  python benchmarks/worker_start.py [--model PATH|tiny] [--rounds 3]
          [--variant before=/path/a --variant after=/path/b:template] [--importtime] [--out F]
Without --model it serves the default model; `tiny` builds the tiny random Llama (2 layers,
hidden 64; SmolLM2's tokenizer borrowed) that benchmarks/autoscale.py serves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from soak import build_tiny_model

from radixserve.client.core_start import CORE_ENV_DEFAULTS
from radixserve.fleet.worker_template import WorkerTemplate, become_subreaper
from radixserve_bench.systems import free_port

POLL_S = 0.1
START_TIMEOUT_S = 600.0
SERVE_FLAGS = ["--host", "127.0.0.1", "--max-total-tokens", "16384"]
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MODES = ("exec", "fork-env", "template")


@dataclass
class Variant:
    name: str
    checkout: str
    mode: str = "exec"
    template: WorkerTemplate | None = None

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, rest = text.partition("=")
        path, _, mode = rest.partition(":")
        if mode and mode not in MODES:
            raise SystemExit(f"--variant {text}: MODE must be one of {MODES}")
        return cls(name, path, mode or "exec")


@dataclass
class StartRound:
    variant: str
    wall_s: float  # launch -> /health 200
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds (user+system)
    core_start: dict = field(default_factory=dict)  # what the core reports (engine.core_start)

    @property
    def total_cpu_s(self) -> float:
        return sum(self.cpu_s.values())


def http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.status, json.loads(reply.read() or b"null")


def wait_healthy(url: str, proc, start: float) -> float:
    while time.monotonic() - start < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"not healthy after {START_TIMEOUT_S:.0f} s")


def cpu_by_role(root: psutil.Process, core_pid: int | None) -> dict[str, float]:
    roles: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        role = "http" if proc.pid == root.pid else "core" if proc.pid == core_pid else "other"
        roles[role] = roles.get(role, 0.0) + times.user + times.system
    return {role: round(seconds, 2) for role, seconds in roles.items()}


def one_round(variant: Variant, model: str | None, log: Path) -> StartRound:
    port = free_port()
    command = [sys.executable, "-m", "radixserve.cli", "serve", *([model] if model else [])]
    command += [*SERVE_FLAGS, "--port", str(port)]
    env = {"PYTHONPATH": variant.checkout, **THREAD_ENV}
    if variant.mode == "fork-env":
        env |= CORE_ENV_DEFAULTS
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    if variant.mode == "template":
        proc = variant.template.start(command, {}, None)
    else:
        with open(log, "ab") as out:
            # cwd: `python -m` puts the working folder ahead of PYTHONPATH on sys.path
            proc = subprocess.Popen(
                command, env=os.environ | env, stdout=out, stderr=out, cwd=variant.checkout
            )
    try:
        wall = wait_healthy(url, proc, started)
        engine = http_json(url + "/server_info")[1]["engine"]
        cpu = cpu_by_role(psutil.Process(proc.pid), engine.get("pid"))
        return StartRound(variant.name, round(wall, 2), cpu, engine.get("core_start", {}))
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def import_seconds(checkout: str, module: str) -> float:
    """Cumulative import time of `module` in a fresh interpreter (-X importtime)."""
    env = os.environ | {"PYTHONPATH": checkout}
    command = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=checkout, check=True)
    err = run.stderr
    top = [line for line in err.splitlines() if re.search(rf"\|\s*{re.escape(module)}$", line)]
    return round(int(top[-1].split("|")[1]) / 1e6, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a path, `tiny`, or none: the default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="NAME=PATH[:MODE]")
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [Variant.parse(v) for v in args.variant] or [Variant("here", os.getcwd())]
    work = Path(tempfile.mkdtemp(prefix="worker_start_"))
    model = args.model
    if model == "tiny":
        model = str(build_tiny_model(work / "tiny"))
    for variant in variants:
        if variant.mode == "template":
            assert become_subreaper(), "a template needs Linux (a child subreaper)"
            variant.template = WorkerTemplate({"PYTHONPATH": variant.checkout, **THREAD_ENV})
    rounds: list[StartRound] = []
    for index in range(args.rounds):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            rounds.append(one_round(variant, model, work / f"{variant.name}.log"))
            print(json.dumps(asdict(rounds[-1]) | {"total_cpu_s": rounds[-1].total_cpu_s}))
    for variant in variants:
        if variant.template is not None:
            variant.template.close()
    imports = {}
    if args.importtime:
        for variant in variants:
            modules = ("radixserve.server.launch", "radixserve.engine.core_process")
            imports[variant.name] = {m: import_seconds(variant.checkout, m) for m in modules}
            print(variant.name, imports[variant.name])
    print_table(rounds)
    if args.out:
        data = {"rounds": [asdict(r) for r in rounds], "imports": imports, "model": args.model}
        Path(args.out).write_text(json.dumps(data, indent=2))
    return 0


def print_table(rounds: list[StartRound]) -> None:
    print("| variant | round | wall s | HTTP CPU s | core CPU s | other CPU s | total CPU s |")
    print("|---|---|---|---|---|---|---|")
    for index, r in enumerate(rounds):
        cells = [r.cpu_s.get(role, 0.0) for role in ("http", "core", "other")]
        row = [r.variant, index, r.wall_s, *cells, round(r.total_cpu_s, 2)]
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    sys.exit(main())
