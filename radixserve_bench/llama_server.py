"""llama.cpp's own server as a `bench compare` peer: its command line, configured as its users
would for the workload, and the F32 GGUF that separates precision from engine.

    -np  = the benchmark's concurrency (parallel slots, continuous batching)
    -c   = slots x (longest prompt + output): every slot holds its longest request
    -t/-tb = the cores; --cache-prompt (per-slot prompt cache); --metrics

`llama-server` runs the default model's GGUF as shipped (Q4_1); `llama-server-f32` runs an
F32 GGUF of the very weights radixserve loads (our cached safetensors folder, converted once
with llama.cpp's own `convert_hf_to_gguf.py` from the same source tree the binary is built
from).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from radixserve.model.loader import weights_folder
from radixserve_bench.llama_build import BUILD_ROOT, cached_binary, fetch_source, missing_tools

GGUF_ROOT = BUILD_ROOT / "gguf"


def llama_server_command(
    binary: Path, gguf: Path, port: int, num_slots: int, max_seq_len: int, threads: int
) -> list[str]:
    """`llama-server` on 127.0.0.1:`port` with `num_slots` slots of `max_seq_len` tokens."""
    if num_slots < 1 or max_seq_len < 1:
        raise ValueError(f"llama-server needs >= 1 slot of >= 1 token; got {num_slots}, "
                         f"{max_seq_len}")  # fmt: skip
    return [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(num_slots), "-c", str(num_slots * max_seq_len),
        "-t", str(threads), "-tb", str(threads), "--cache-prompt", "--metrics",
        "--alias", gguf.stem,
    ]  # fmt: skip


def f32_gguf_path(model: str | None) -> Path:
    """Where the F32 GGUF of `model`'s weights is cached."""
    return GGUF_ROOT / f"{weights_folder(model).name}-f32.gguf"


def convert_f32_gguf(model: str | None, log=sys.stderr) -> Path:
    """The F32 GGUF of the weights radixserve loads for `model`, converted on first use."""
    out = f32_gguf_path(model)
    if out.exists():
        return out
    _, source = fetch_source()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), "--outtype", "f32",
               "--outfile", str(partial), str(weights_folder(model))]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(source / "gguf-py")}  # its own gguf-py, in step
    subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    shutil.move(partial, out)
    return out


def unavailable_reason() -> str | None:
    """Why llama-server cannot run here (not built, and no compiler to build it), or None."""
    if cached_binary() is None and (missing := missing_tools()):
        return f"llama-server is not built and building it needs {', '.join(missing)} on PATH"
    return None
