"""The agent examples run end to end as scripts: in-process on the default model (short runs),
and one against a running server. They check that each program finishes and reports its
cache hits, never what the model wrote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
TIMEOUT_S = 180
REPORT = re.compile(r"engine: \d+ requests, [1-9]\d*/\d+ prompt tokens from the radix cache")


def start_example(name: str, *flags: str) -> subprocess.Popen:
    """Starts examples/agents/`name` with a small --max-tokens."""
    cmd = [sys.executable, str(EXAMPLES / name), "--max-tokens", "8", *flags]
    env = os.environ | {"PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_example(name: str, proc: subprocess.Popen) -> str:
    """Waits for a started example; returns its stdout once it exited cleanly."""
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{name} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout


def run_example(name: str, *flags: str) -> str:
    """Runs examples/agents/`name` with a small --max-tokens; returns its stdout."""
    return finish_example(name, start_example(name, *flags))


IN_PROCESS = [
    pytest.param(
        "react_tools.py",
        ["--num", "2"],
        r"round 1 \(cached/prompt [1-9]\d*/\d+\)",
        id="react_tools",
    ),
    pytest.param(
        "tree_of_thought.py",
        ["--num", "2"],
        r"level 2:\n.*cached/prompt [1-9]\d*/\d+\]",
        id="tree_of_thought",
    ),
    pytest.param(
        "few_shot_qa.py",
        ["--num", "3"],
        r"\[cached/prompt [1-9]\d*/\d+\] What is 2 plus 2\?",
        id="few_shot_qa",
    ),
    pytest.param(
        "multi_turn_chat.py",
        ["--num", "2"],
        r"turn 2 {2}\(cached/prompt tokens [1-9]\d*/\d+\)",
        id="multi_turn_chat",
    ),
]


@pytest.fixture(scope="module")
def in_process_runs():
    """Every in-process example, started at once: each spends most of its time importing and
    loading the model on one core, so side by side they share the machine's cores instead of
    queueing. Each test then waits for its own."""
    procs = {}
    for case in IN_PROCESS:
        name, flags, _ = case.values
        procs[name] = start_example(name, *flags)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("name, flags, expected", IN_PROCESS)
def test_example_runs_in_process(in_process_runs, name: str, flags: list[str], expected: str):
    out = finish_example(name, in_process_runs[name])
    assert re.search(expected, out), out
    assert REPORT.search(out), out


def test_example_runs_against_a_server(server):
    """The ReAct agent (run_batch, select, gen with stop, tools) over RuntimeEndpoint."""
    out = run_example("react_tools.py", "--url", server.url, "--num", "2")
    assert f"backend: {server.url}" in out and "round 1 (cached/prompt" in out
    assert REPORT.search(out), out
