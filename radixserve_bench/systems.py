"""The systems `bench compare` measures, each a server it starts on a free loopback port.

radixserve               radix cache, lpm scheduling (the product)
radixserve-no-cache      --disable-radix-cache: every prompt token prefilled
radixserve-fcfs          --schedule-policy fcfs: cache on, arrival order
radixserve-gguf          --quantization gguf: the GGUF's Q4_1 blocks as shipped (bfloat16)
hf-transformers          `model.generate` on static batches (radixserve_bench.hf_server)
hf-transformers-cb       transformers' continuous batching (paged cache, prefix sharing)
llama-cpp                llama-cpp-python's OpenAI server on the same GGUF, when installed
                         (one request at a time)
llama-server             llama.cpp's own server (slots, continuous batching, prompt cache) on
                         the GGUF as shipped; built on demand (radixserve_bench.llama_build)
llama-server-f32         the same on an F32 GGUF of the weights radixserve loads
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from radixserve.model.source import resolve_model


@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str
    """radixserve | hf | llama-cpp | llama-server: which server program runs."""
    backend: str
    """The bench backend that talks to it (radixserve: native /generate)."""
    flags: tuple[str, ...] = ()
    """Extra command-line flags of its server."""
    weights: str = "dtype"
    """The report's quant column: auto (radixserve's default --quantization auto: on CPU the
    default model's GGUF blocks as shipped, else --dtype) | dtype (the server's --dtype: fp32
    on CPU) | gguf-shipped (the model's GGUF as shipped, e.g. Q4_1) | gguf-f32 (an F32 GGUF
    of the same weights). For llama-server it also picks the file."""


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("radixserve", "radixserve", "radixserve", (), "auto"),
        SystemSpec("radixserve-fp32", "radixserve", "radixserve", ("--quantization", "none")),
        SystemSpec("radixserve-no-cache", "radixserve", "radixserve", ("--disable-radix-cache",)),
        SystemSpec("radixserve-fcfs", "radixserve", "radixserve", ("--schedule-policy", "fcfs")),
        SystemSpec("radixserve-gguf", "radixserve", "radixserve", ("--quantization", "gguf"),
                   "gguf-shipped"),
        SystemSpec("hf-transformers", "hf", "radixserve"),
        SystemSpec("hf-transformers-cb", "hf", "radixserve", ("--batching", "continuous")),
        SystemSpec("llama-cpp", "llama-cpp", "llama-cpp", (), "gguf-shipped"),
        SystemSpec("llama-server", "llama-server", "llama-server", (), "gguf-shipped"),
        SystemSpec("llama-server-f32", "llama-server", "llama-server", (), "gguf-f32"),
    )
}  # fmt: skip
HEALTH_PATHS = {"radixserve": "/health", "hf": "/health", "llama-cpp": "/v1/models",
                "llama-server": "/health"}  # fmt: skip


@dataclass
class LaunchOptions:
    """How `bench compare` starts its systems."""

    model: str | None = None
    """Model of every system: HF folder, .gguf or None for the default (SmolLM2)."""
    server_args: str = ""
    """Extra flags for every radixserve server, e.g. "--max-total-tokens 65536"."""
    hf_max_batch_size: int | None = None
    """Static batch size of the transformers baseline (default: --max-concurrency, else 16)."""
    llama_server_args: str = ""
    """Extra flags for llama-server, e.g. "--no-repack" where its AMX / repacked kernels
    crash (a Q4_1 GGUF on this 2-core VM's AMX build: SIGSEGV at the first forward)."""
    llama_cpp_ctx: int = 8192
    """llama-cpp-python's context length (n_ctx); llama-server's is sized per workload."""
    startup_timeout: float = 600.0
    """Seconds a server may take to become ready."""


def parse_systems(names: str) -> list[SystemSpec]:
    """The systems named in a comma-separated list, in that order."""
    specs = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        specs.append(SYSTEMS[name])
    if not specs:
        raise ValueError("systems: name at least one system")
    return specs


def unavailable_reason(spec: SystemSpec, options: LaunchOptions) -> str | None:
    """Why `spec` cannot run here, or None."""
    if spec.kind == "llama-cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
        if gguf_path(options.model) is None:
            return "llama.cpp needs a .gguf model"
    if spec.weights == "gguf-shipped" and gguf_path(options.model) is None:
        return f"{spec.name} runs the GGUF as shipped and needs a .gguf model"
    if spec.kind == "llama-server":
        from radixserve_bench.llama_server import unavailable_reason as llama_server_reason

        return llama_server_reason()
    return None


def gguf_path(model: str | None) -> Path | None:
    source = resolve_model(model)
    return source.path if source.kind == "gguf" else None


def server_command(
    spec: SystemSpec, options: LaunchOptions, port: int, max_batch: int, max_seq_len: int = 0
) -> list[str]:
    """The command line that serves `spec` on 127.0.0.1:`port`, for `max_batch` concurrent
    requests of at most `max_seq_len` tokens (prompt + output)."""
    model = [options.model] if options.model else []
    if spec.kind == "radixserve":
        flags = [*spec.flags, *shlex.split(options.server_args)]
        serve = [sys.executable, "-m", "radixserve.cli", "serve", *model]
        return [*serve, "--port", str(port), *flags]
    if spec.kind == "hf":
        model_flag = ["--model", options.model] if options.model else []
        # requests sent together (the next wave of a concurrency-limited client) share a batch
        wait = ["--batch-wait-ms", "100"]
        batch = ["--max-batch-size", str(options.hf_max_batch_size or max_batch), *wait]
        return [sys.executable, "-m", "radixserve_bench.hf_server", *model_flag, "--port",
                str(port), *batch, *spec.flags]  # fmt: skip
    if spec.kind == "llama-server":
        return _llama_server_command(spec, options, port, max_batch, max_seq_len)
    threads = str(cpu_threads())
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path(options.model)),
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(options.llama_cpp_ctx),
        "--n_threads", threads, "--n_threads_batch", threads, "--model_alias", spec.name,
        "--interrupt_requests", "False",  # its default drops a running stream for a new request
    ]  # fmt: skip


def _llama_server_command(
    spec: SystemSpec, options: LaunchOptions, port: int, max_batch: int, max_seq_len: int
) -> list[str]:
    """Builds llama-server and converts the F32 GGUF first where they are not cached."""
    from radixserve_bench.llama_build import build_llama_server
    from radixserve_bench.llama_server import convert_f32_gguf, llama_server_command

    try:
        binary = build_llama_server()
        f32 = spec.weights == "gguf-f32"
        gguf = convert_f32_gguf(options.model) if f32 else gguf_path(options.model)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"preparing {spec.name} failed: {exc}") from exc
    threads = cpu_threads()
    command = llama_server_command(binary, gguf, port, max_batch, max_seq_len, threads)
    return [*command, *shlex.split(options.llama_server_args)]


def cpu_threads() -> int:
    """The threads a peer gets: what OMP_NUM_THREADS gives radixserve and torch, else every
    core, so that every system in a run computes on as many threads."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else os.cpu_count() or 1


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """A first port of `count` consecutive ports nothing listens on right now (a fleet's
    workers listen on a base port + i)."""
    for _ in range(50):
        first = free_port()
        if first + count < 65536 and all(_port_free(first + k) for k in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ManagedServer:
    """A server subprocess: started, polled until healthy, stopped with SIGTERM."""

    def __init__(self, command: list[str], health_path: str, log_path: Path, port: int):
        self.command, self.health_path, self.log_path = command, health_path, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        """Starts the process; raises RuntimeError (with its log's tail) unless it gets healthy."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, num_lines: int = 20) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(
    spec: SystemSpec, options: LaunchOptions, max_batch: int, log_dir: Path, max_seq_len: int = 0
) -> ManagedServer:
    """Starts `spec` on a free port and waits until it answers its health check."""
    port = free_port()
    command = server_command(spec, options, port, max_batch, max_seq_len)
    server = ManagedServer(command, HEALTH_PATHS[spec.kind], log_dir / f"{spec.name}.log", port)
    server.start(options.startup_timeout)
    return server
