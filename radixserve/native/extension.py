"""Builds radixserve's C++ CPU kernels (csrc/) on first use and loads them, cached per machine.

One extension, one build: `torch.utils.cpp_extension` compiles every csrc/*.cpp once into
<cache_root>/torch_extensions/<name>_<key>; the key hashes the sources and their headers
(HEADERS), where they lie, the torch version and the compiler flags. One source per kernel
family; each has its Python wrapper beside its caller (simd.h: the matmuls' shared vectors):

    paged_decode.cpp, paged_extend.cpp  attention                 attention/cpu_fused.py
    layer_ops.cpp                       a layer's fused small ops model/cpu_layer_ops.py
    block_matmul.cpp (block_dequant.h)  GGUF-block matmuls        model/quant/block_matmul.py
    int4_x8.cpp                         Q4_0 / Q4_1 8-row packing model/quant/linear.py
    dense_matmul.cpp                    batch-invariant matmul    model/quant/batch_invariant.py
    kquant_matmul.cpp (kquant_*.h)      GGUF K-quant matmuls      model/quant/kquant.py
    q8_matmul.cpp (q8_*.h)              int8-activation matmuls   model/quant/q8_matmul.py
                                        (q8_kquant_x8.h: Q4_K 8 rows at a time)
    moe_experts.cpp                     MoE experts in one call   model/moe.py
    lora_segments.cpp                   multi-LoRA row segments   model/lora_segments.py
    decode_stack.cpp                    a decode step's layers    model/cpu_decode_stack.py

The SIMD flags follow the level torch itself detected on this CPU at run time
(`torch.backends.cpu.get_cpu_capability()`, never assumed), so a cached build never runs on a
CPU or torch it was not built for. On the AVX512 level, `-mavx512vnni` is added where
/proc/cpuinfo lists `avx512_vnni` (machine.py): the int8-activation kernels' integer dot
(`int_dot_level()` says which). `ATEN_CPU_CAPABILITY=avx2` or `=default` (torch's own
switch) lowers that level for torch's kernels and ours alike: AVX2 + FMA intrinsics, or
portable loops (`simd_level()` says which one a build has). Without a compiler (or when the
build fails) `load_cpu_ops` raises `CpuExtensionUnavailable` with the reason; callers then
use their torch references.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.disk_cache import cache_root, exclusive

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / "paged_decode.cpp",
    CSRC / "paged_extend.cpp",
    CSRC / "layer_ops.cpp",
    CSRC / "block_matmul.cpp",
    CSRC / "int4_x8.cpp",
    CSRC / "dense_matmul.cpp",
    CSRC / "kquant_matmul.cpp",
    CSRC / "q8_matmul.cpp",
    CSRC / "moe_experts.cpp",
    CSRC / "lora_segments.cpp",
    CSRC / "decode_stack.cpp",
    CSRC / "seeded_noise.cpp",
]
HEADERS = [
    CSRC / "common.h",
    CSRC / "simd.h",
    CSRC / "block_dequant.h",
    CSRC / "paged_extend_blocks.h",
    CSRC / "paged_decode_blocks.h",
    CSRC / "paged_decode_grouped.h",
    CSRC / "kquant_blocks.h",
    CSRC / "kquant_simd.h",
    CSRC / "q8_simd.h",
    CSRC / "q8_dual.h",
    CSRC / "q8_formats.h",
    CSRC / "q8_kquant_x8.h",
    CSRC / "q8_kquant_x8_ymm.h",
    CSRC / "q8_int4_x8.h",
]
OPS_NAMESPACE = "radixserve_cpu"  # TORCH_LIBRARY(radixserve_cpu, ...) in the sources
# Per SIMD level torch picked for this CPU (torch.backends.cpu.get_cpu_capability()); the
# same instruction sets torch's own kernels of that level use. Other levels: portable code.
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],  # F16C: every AVX2 CPU (q8_kquant_x8_ymm.h)
}


class CpuExtensionUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded here; the message says why."""


_loaded: Any = None
_failure: CpuExtensionUnavailable | None = None


def compiler_flags() -> list[str]:
    """-O3, OpenMP (at::parallel_for) and the SIMD flags of this CPU's level (with AVX512:
    VNNI where the CPU has it). The flags are part of the build key.

    -fno-trapping-math: the kernels never read the floating-point exception flags, and with
    GCC's default a loop whose float math sits behind a branch (a softmax's exp of the scores
    above -87) stays scalar; no value changes (no reassociation, no contraction)."""
    from radixserve.native.machine import cpu_flags

    level = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", *_ARCH_FLAGS.get(level, [])]
    if level == "AVX512" and "avx512_vnni" in cpu_flags():
        flags.append("-mavx512vnni")
    return flags


def kernels_key(flags: list[str] | None = None) -> str:
    """Hash of what the kernels compute and how fast: sources, headers, torch version and
    flags (this machine's when None), wherever the checkout lies. A measured kernel choice
    keys its cached verdict by it, so a changed kernel is measured again."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(compiler_flags() if flags is None else flags).encode())
    return digest.hexdigest()[:16]


def build_key(flags: list[str]) -> str:
    """Hash of everything that makes a build valid: kernels_key and where the sources lie
    (the build files name them by absolute path: two checkouts sharing one cache would
    otherwise rebuild each other's)."""
    digest = hashlib.sha256(kernels_key(flags).encode())
    digest.update(str(CSRC).encode())
    return digest.hexdigest()[:16]


def load_cpu_ops() -> Any:
    """`torch.ops.radixserve_cpu`, building it on the first call of the process (then cached
    on disk). Raises CpuExtensionUnavailable, every call, once a build has failed."""
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise _failure
    try:
        _loaded = _build_and_load()
    except Exception as exc:  # any build/load failure means: use the reference path
        _failure = CpuExtensionUnavailable(f"C++ CPU kernels unavailable: {exc}")
        raise _failure from exc
    return _loaded


def loaded_cpu_ops() -> Any | None:
    """`torch.ops.radixserve_cpu` if this process has already loaded it, else None: for
    callers that may use the kernels but must never start a build (the sampler)."""
    return _loaded


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package (a dependency) ships one
    in the venv's bin folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


BUILD_LOCK = "radixserve-build.lock"
TORCH_BATON = "lock"
"""torch's cpp_extension marks a build in progress by creating this file in the build folder
and waits, polling forever, while it exists; a build killed midway leaves it behind."""


def build_folder(flags: list[str]) -> Path:
    """Where the extension for `flags` is built and cached."""
    return cache_root() / "torch_extensions" / f"radixserve_cpu_{build_key(flags)}"


def clear_stale_baton(folder: Path) -> None:
    """Removes torch's build marker left by a build that died (only called under BUILD_LOCK,
    which every live builder of `folder` holds): without this every later start would wait
    on it forever."""
    baton = folder / TORCH_BATON
    if baton.exists():
        logger.warning("removing %s, left by a C++ kernel build that did not finish", baton)
        baton.unlink(missing_ok=True)


def _build_and_load() -> Any:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on PATH")
    _put_ninja_on_path()
    cpp_extension.verify_ninja_availability()
    flags = compiler_flags()
    folder = build_folder(flags)  # hashes every source once
    name = folder.name
    start = time.perf_counter()
    with exclusive(folder / BUILD_LOCK):  # every builder of this folder holds it first, so
        clear_stale_baton(folder)  # a torch baton found while holding it is a dead build's
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
        )
    logger.info("loaded C++ CPU kernels %s in %.1fs", name, time.perf_counter() - start)
    return getattr(torch.ops, OPS_NAMESPACE)
