"""Tensor-parallel ranks start from a module entry point (nothing re-imports the caller's
`__main__`), and a rank that dies or stays silent while starting ends Engine(...) in bounded
time with an error naming it and its last output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve.config import CacheConfig, LoadConfig, ParallelConfig
from radixserve.distributed.group import RankFailedError
from radixserve.model.tp_runner import TPModelRunner

START_DEADLINE_S = 120.0
"""Generous for a loaded 2-core machine: two interpreters importing torch, a tiny model."""
STDIN_PROGRAM = """
from radixserve import Engine
engine = Engine({model!r}, tp_size=2, device="cpu", max_total_tokens=512)
out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={{"max_new_tokens": 3,
                      "temperature": 0, "ignore_eos": True}})
print("TOKENS", len(out[0]["output_ids"]), flush=True)
engine.shutdown()
"""


def test_an_engine_with_tp2_starts_from_a_program_read_on_stdin(tiny_chat_model):
    program = STDIN_PROGRAM.format(model=tiny_chat_model)
    done = subprocess.run(
        [sys.executable, "-"],
        input=program,
        capture_output=True,
        text=True,
        timeout=START_DEADLINE_S,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS 3" in done.stdout


def _rank_hook(folder: Path, body: str) -> dict[str, str]:
    """An environment whose new interpreters, the ranks alone here (this one has started
    already), run `body` first: a sitecustomize on PYTHONPATH."""
    (folder / "sitecustomize.py").write_text(body)
    paths = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _start(model: str, timeout_s: float) -> TPModelRunner:
    return TPModelRunner.create(
        LoadConfig(model=model, device="cpu"),
        CacheConfig(page_size=16, max_total_tokens=512),
        ParallelConfig(tp_size=2, dist_timeout=timeout_s),
    )


def test_a_rank_that_dies_while_starting_is_named_with_its_last_output(
    tiny_chat_model, tmp_path, monkeypatch
):
    hook = "import os, sys\nsys.stderr.write('rank hook: no device here\\n')\nos._exit(3)\n"
    for name, value in _rank_hook(tmp_path, hook).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 exited \(code 3\).*no device here"):
        _start(tiny_chat_model, timeout_s=300)  # noticed at once, not at the timeout
    assert time.monotonic() - start < START_DEADLINE_S / 2


def test_a_silent_rank_ends_the_start_within_the_timeout(tiny_chat_model, tmp_path, monkeypatch):
    hook = "import sys, time\nsys.stderr.write('rank hook: stuck\\n')\nsys.stderr.flush()\n"
    for name, value in _rank_hook(tmp_path, hook + "time.sleep(600)\n").items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 did not report hello.*stuck"):
        _start(tiny_chat_model, timeout_s=5)
    assert time.monotonic() - start < 5 + 20  # the timeout, then stopping the rank
