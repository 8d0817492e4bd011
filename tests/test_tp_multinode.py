"""Multi-node tensor parallelism on loopback: two "nodes" (processes started separately, gloo),
tp 2 over --nnodes 2. Greedy output equals one process; node 0 stopping stops node 1 (exit 0);
a node that dies stops the serving node (503, exit non-zero) in bounded time; bad flag
combinations fail at start, naming the flag.

Each pair of nodes is two interpreters loading a tiny model: kept to two pairs (two cores)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import requests

from conftest import ServerProcess, free_port, greedy, greedy_generate, make_runner
from radixserve.cli import main
from radixserve.config import CacheConfig, LoadConfig, ParallelConfig
from radixserve.model.tp_runner import TPModelRunner

PROMPTS = [[(i * 37 + j * 11) % 250 + 3 for j in range(n)] for i, n in enumerate((19, 5, 33))]
SERVER_TOKENS = 16384  # ServerProcess's --max-total-tokens: every node gives the same
NODE_EXIT_S = 60.0
"""Bound on a node's exit once the group stops (generous: a loaded 2-core machine)."""


def start_node(model: str, init_addr: str, max_total_tokens: int = 1024) -> subprocess.Popen:
    """`radixserve serve --node-rank 1`: node 1's ranks, no HTTP."""
    command = [sys.executable, "-m", "radixserve.cli", "serve", model, "--device", "cpu"]
    command += ["--tp-size", "2", "--nnodes", "2", "--node-rank", "1"]
    command += ["--dist-init-addr", init_addr, "--max-total-tokens", str(max_total_tokens)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(node: subprocess.Popen, timeout_s: float = NODE_EXIT_S) -> tuple[int, str]:
    """The node's exit code and output (killed if it does not exit in time)."""
    try:
        output, _ = node.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        node.kill()
        output, _ = node.communicate()
        return -999, output
    return node.returncode, output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-size", "3", "--nnodes", "2"], "--nnodes 2 must divide --tp-size 3"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in"),
        (["--tp-size", "2", "--nnodes", "0"], "--nnodes must be >= 1"),
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:0"], "fixed port"),
    ],
)
def test_bad_node_flags_fail_at_start_naming_the_flag(flags, message):
    for command in ("serve", "generate"):
        argv = [command, *(["hello"] if command == "generate" else []), *flags]
        with pytest.raises(SystemExit, match=message):
            main(argv)


def test_only_node_zero_runs_the_engine(tiny_chat_model):
    with pytest.raises(ValueError, match="--node-rank 1: only node 0"):
        TPModelRunner.create(
            LoadConfig(model=tiny_chat_model, device="cpu"),
            CacheConfig(page_size=16, max_total_tokens=512),
            ParallelConfig(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1"),
        )


def test_tp2_over_two_nodes_matches_one_process_and_stops_both(tiny_chat_model):
    expected = greedy_generate(make_runner(tiny_chat_model, max_total_tokens=1024), PROMPTS, 8)
    init_addr = f"127.0.0.1:{free_port()}"
    node = start_node(tiny_chat_model, init_addr)  # before node 0: it waits to join
    try:
        runner = TPModelRunner.create(
            LoadConfig(model=tiny_chat_model, device="cpu"),
            CacheConfig(page_size=16, max_total_tokens=1024),
            ParallelConfig(tp_size=2, nnodes=2, dist_init_addr=init_addr),
        )
        try:
            assert runner.workers == []  # rank 1 is node 1's, not a child of node 0
            assert greedy_generate(runner, PROMPTS, 8) == expected
        finally:
            runner.close()
        code, output = finish(node)
        assert code == 0, output[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


@pytest.fixture(scope="module")
def two_node_server(tiny_chat_model):
    init_addr = f"127.0.0.1:{free_port()}"
    node = start_node(tiny_chat_model, init_addr, SERVER_TOKENS)
    flags = ["--device", "cpu", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", init_addr]
    try:
        server = ServerProcess(tiny_chat_model, *flags)
    except BaseException:
        node.kill()
        node.wait()
        raise
    yield server, node
    for proc in (node, server.proc):
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_node_that_dies_stops_the_serving_node_with_503(two_node_server):
    server, node = two_node_server
    body = {"input_ids": PROMPTS[0], "sampling_params": greedy(4)}
    first = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert len(first.json()["output_ids"]) == 4
    node.send_signal(signal.SIGKILL)
    node.wait()
    start = time.monotonic()
    second = requests.post(f"{server.url}/generate", json=body, timeout=NODE_EXIT_S)
    assert second.status_code == 503, second.text
    assert server.proc.wait(NODE_EXIT_S) != 0
    assert time.monotonic() - start < NODE_EXIT_S
    assert "tensor-parallel step failed" in "".join(server.log)
