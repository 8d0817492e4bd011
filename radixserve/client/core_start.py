"""How `radixserve serve` starts its engine core process: fork (the core reuses every module
the HTTP process imported: torch, transformers, radixserve) or spawn (a fresh interpreter that
imports them all again: ~3-4 s of CPU; docs/performance.md, "A worker's start").

fork is chosen only where the forked core is the process spawn would have made:
- nothing else runs in this process yet (one thread; CUDA not initialized), so no lock or
  thread pool is copied half-held;
- OpenMP read CORE_ENV_DEFAULTS (or the user's values) when torch loaded: libgomp reads its
  variables once, at load, and a forked core keeps the parent's reading. They were in the
  exec environment, or `radixserve serve` set them before any OpenMP runtime loaded
  (set_openmp_defaults: the command line does not load torch before it; radixserve/__init__.py);
- no API key was in this process's environment at exec: a forked child's /proc/PID/environ
  shows its parent's exec-time environment, popped variables included (config/keys.py drops
  the key variables so that the core never carries them).
RADIXSERVE_CORE_START_METHOD=spawn forces spawn (vLLM's VLLM_WORKER_MULTIPROC_METHOD).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from radixserve.config.keys import KEY_SOURCES
from radixserve.native.openmp import openmp_loaded

START_METHOD_ENV = "RADIXSERVE_CORE_START_METHOD"
START_METHODS = ("auto", "spawn")
CORE_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
"""Set for the core process unless the user set them. OpenMP threads that spin without end
while they wait fight the HTTP process and anything else for the cores (2 busy cores: SmolLM2
4.7 tok/s spinning vs 10.9 passive); a short spin (GOMP_SPINCOUNT) before sleeping keeps the
idle-machine speed (25 vs 18 tok/s passive). Measurements: docs/performance.md."""


_openmp_read_defaults = False  # set_openmp_defaults ran before any OpenMP runtime loaded


def set_openmp_defaults() -> bool:
    """Sets CORE_ENV_DEFAULTS in this process's environment where unset; returns whether the
    OpenMP runtime will read them, i.e. none is loaded yet (then the core may fork)."""
    global _openmp_read_defaults
    for name, value in CORE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if openmp_loaded() is False:
        _openmp_read_defaults = True
    return _openmp_read_defaults


@dataclass(frozen=True)
class StartChoice:
    """The start method for the core and, for spawn, why not fork."""

    method: str  # fork | spawn
    reason: str = ""


def exec_environ_names(path: str = "/proc/self/environ") -> set[str] | None:
    """The variable names of this process's exec-time environment (None: not readable)."""
    try:
        with open(path, "rb") as file:
            entries = file.read().split(b"\0")
    except OSError:
        return None
    return {entry.split(b"=", 1)[0].decode(errors="replace") for entry in entries if entry}


def choose_start_method(environ=os.environ) -> StartChoice:
    """fork where it is safe and saves the core's imports (see the module docstring)."""
    requested = environ.get(START_METHOD_ENV, "auto")
    if requested not in START_METHODS:
        raise ValueError(f"${START_METHOD_ENV} must be one of {START_METHODS}, not {requested!r}")
    if requested == "spawn":
        return StartChoice("spawn", f"${START_METHOD_ENV}=spawn")
    reason = _fork_unsafe_reason()
    return StartChoice("spawn", reason) if reason else StartChoice("fork")


def _fork_unsafe_reason() -> str:
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "fork is used on Linux only"
    if threading.active_count() > 1:
        return "this process already runs threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    names = exec_environ_names()
    if names is None:
        return "/proc/self/environ cannot be read"
    if keys := [s.env for s in KEY_SOURCES if s.env in names]:
        return f"{', '.join(keys)} was in the exec environment"
    missing = [name for name in CORE_ENV_DEFAULTS if name not in names]
    if missing and not _openmp_read_defaults:
        return f"OpenMP started without {', '.join(missing)} (set it to fork)"
    return ""
