"""The process's OpenMP runtime (native/openmp.py): which one torch uses, and an Engine that
leaves one team of workers in the process (the core thread's), not two: with two, libgomp
throttles every barrier's spinning once its workers outnumber the cores."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from radixserve.native.openmp import openmp_library, openmp_loaded, release_thread_team


def write_maps(path, *libraries: str) -> str:
    lines = [f"7f0{i}-7f1{i} r-xp 0 08:01 {i} {lib}" for i, lib in enumerate(libraries)]
    path.write_text("\n".join(["7f00-7f01 rw-p 0 00:00 0", *lines]) + "\n")
    return str(path)


def test_openmp_loaded_reads_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    assert openmp_loaded(write_maps(maps, "/usr/lib/libc.so.6")) is False
    assert openmp_loaded(write_maps(maps, "/site-packages/torch/lib/libgomp.so.1")) is True
    assert openmp_loaded(str(tmp_path / "missing")) is None


def test_torchs_runtime_is_chosen_over_other_packages_private_copies(tmp_path):
    maps = tmp_path / "maps"
    private = "/site-packages/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"  # sorts first
    torchs = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    assert openmp_library(write_maps(maps, private, torchs)) == torchs
    # a torch built against the system's runtime: the plain name, never the private copy
    system = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
    assert openmp_library(write_maps(maps, private, system)) == system
    intel = "/opt/intel/lib/libiomp5.so"  # Intel's runtime under its plain name
    assert openmp_library(write_maps(maps, private, intel)) == intel
    assert openmp_library(write_maps(maps, private)) is None
    assert openmp_library(str(tmp_path / "missing")) is None


ONE_TEAM = """
import os, sys, time
import torch
from radixserve import Engine
from radixserve.native.openmp import release_thread_team

threads = lambda: len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
before = threads()
torch.ones(1 << 22).mul_(2)  # a parallel region on this thread: it gets a team
assert threads() == before + 1, "no OpenMP worker started"
assert release_thread_team() and threads() == before, "the team was not released"
torch.ones(1 << 22).mul_(2)  # the caller's team again, as a user's own torch code makes it
engine = Engine(sys.argv[1], max_total_tokens=2048, page_size=16)
assert engine.client.released_caller_team
engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0})  # the core thread's team
running = threads()
release_thread_team()
assert threads() == running, "the Engine left a second team on the caller's thread"
# idle, the core thread hands its own team back (a second engine's steps run alone)
for _ in range(500):
    if engine.client._transport.idle_releases >= 2:  # at start, and after the request
        break
    time.sleep(0.01)
assert engine.client._transport.idle_releases >= 2, engine.client._transport.idle_releases
engine.shutdown()
print("one team")
"""


def test_an_engine_leaves_one_openmp_team_in_the_process(tiny_chat_model):
    # in a fresh process: the count of OpenMP workers is per process and this one's tests
    # have made teams on other threads already
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", ONE_TEAM, tiny_chat_model],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one team" in done.stdout


def test_release_outside_any_runtime_says_so(monkeypatch):
    monkeypatch.setattr("radixserve.native.openmp._pause", None)
    monkeypatch.setattr("radixserve.native.openmp.openmp_library", lambda: None)
    assert release_thread_team() is False
