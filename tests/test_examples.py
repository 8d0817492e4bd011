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


def run_example(name: str, *flags: str) -> str:
    """Runs examples/agents/`name` with a small --max-tokens; returns its stdout."""
    cmd = [sys.executable, str(EXAMPLES / name), "--max-tokens", "8", *flags]
    env = os.environ | {"PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize(
    "name, flags, expected",
    [
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
    ],
)
def test_example_runs_in_process(name: str, flags: list[str], expected: str):
    out = run_example(name, *flags)
    assert re.search(expected, out), out
    assert REPORT.search(out), out


def test_example_runs_against_a_server(server):
    """The ReAct agent (run_batch, select, gen with stop, tools) over RuntimeEndpoint."""
    out = run_example("react_tools.py", "--url", server.url, "--num", "2")
    assert f"backend: {server.url}" in out and "round 1 (cached/prompt" in out
    assert REPORT.search(out), out
