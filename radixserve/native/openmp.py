"""The process's OpenMP runtime (torch's libgomp; our kernels' at::parallel_for runs on it):
whether one is loaded, and handing back a thread's idle OpenMP workers.

Why the latter matters: every thread that runs a parallel region keeps its own team of
workers, and libgomp counts them all. Once the count exceeds the CPUs it may use, every
worker of every team stops spinning at barriers after ~100 spins and sleeps on a futex, so
each of a decode step's ~300 parallel regions pays a wake-up (tens of microseconds on a VM).
`Engine` loads the model on the caller's thread (a team) and steps on its core thread (a
second team): on 2 cores and 2 threads a default-model decode step took 11-12 ms there
against 6.3 ms on one team (docs/performance.md, "One OpenMP team per process").
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")
PLAIN_NAME = re.compile(r"(libgomp|libiomp5?|libomp)\.so")  # not a private libgomp-<hash>.so
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads go, the runtime stays initialised


def _mapped_openmp(maps_path: str) -> list[str] | None:
    """The OpenMP runtimes' paths in a memory map (None: the map cannot be read)."""
    try:
        with open(maps_path) as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return None
    paths = {f[5].strip() for f in fields if len(f) == 6}
    return sorted(p for p in paths if any(n in p.rsplit("/", 1)[-1] for n in OPENMP_LIBRARIES))


def openmp_library(maps_path: str = "/proc/self/maps") -> str | None:
    """The path of torch's OpenMP runtime in this process, or None (none is loaded, or the map
    cannot be read). Other packages may map private copies (sentencepiece's
    libgomp-<hash>.so); torch's is the one under its own directory or, for a torch built
    against the system's, the one under its plain name."""
    found = _mapped_openmp(maps_path) or []
    torch = sys.modules.get("torch")
    torch_dir = (
        os.path.dirname(torch.__file__) + os.sep if getattr(torch, "__file__", None) else None
    )
    for path in found:
        if torch_dir and path.startswith(torch_dir):
            return path
    plain = [p for p in found if PLAIN_NAME.match(p.rsplit("/", 1)[-1])]
    return plain[0] if plain else None


def openmp_loaded(maps_path: str = "/proc/self/maps") -> bool | None:
    """Whether an OpenMP runtime is mapped into this process (None: the map cannot be read)."""
    found = _mapped_openmp(maps_path)
    return None if found is None else bool(found)


_pause = None  # torch's omp_pause_resource_all, once found


def release_thread_team() -> bool:
    """Ends the calling thread's idle OpenMP workers (OpenMP 5.0 `omp_pause_resource_all`,
    soft: libgomp frees the caller's team only; a later parallel region on this thread
    starts a new one, ~0.1 ms). Returns whether a runtime took the call; False where none is
    loaded, it lacks the call, or the caller is inside a parallel region."""
    global _pause
    if _pause is None:
        path = openmp_library()
        if path is None:
            return False
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            return False
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        _pause = pause
    return _pause(OMP_PAUSE_SOFT) == 0
