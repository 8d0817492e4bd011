"""How `serve` starts its engine core (client/core_start.py): forked from the server process,
which has imported torch, transformers and radixserve already, or spawned, importing them all
again; what the core imported itself is reported in /server_info's engine.core_start."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from native_http import get, post, run

from conftest import API_KEY
from radixserve.client.client import EngineDeadError
from radixserve.client.core_client import MultiprocessClient
from radixserve.client.core_start import (
    CORE_ENV_DEFAULTS,
    START_METHOD_ENV,
    StartChoice,
    choose_start_method,
    exec_environ_names,
)
from radixserve.config.keys import ADMIN_API_KEY_ENV
from radixserve.engine.protocol import StartFailed
from radixserve.engine.wire import encode
from radixserve.model.source import default_model_path
from radixserve.model.tokenizer import model_tokenizer
from radixserve.server.launch import EarlyTokenizer


def core_start(server, key: str | None = None) -> dict:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    status, info = run(get(server.url + "/server_info", headers=headers))
    assert status == 200
    return info["engine"]["core_start"]


def test_the_core_forks_and_imports_nothing_heavy_again(server):
    # a plain `radixserve serve`: OpenMP's variables were not in its exec environment; the
    # command line set them before torch loaded
    assert not set(CORE_ENV_DEFAULTS) & set(os.environ)
    start = core_start(server)
    assert start["start_method"] == "fork" and start["reason"] == "", start
    # the server opened its tokenizer while the core loaded, and it is the core's
    assert start["tokenizer_opened_early"] is True
    assert start["engine_imported_in"] == "parent"
    # torch, transformers (with what a tokenizer load pulls in) and the engine: all inherited
    assert start["heavy_modules_imported"] == []
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 4


def test_a_key_in_the_exec_environment_makes_the_core_spawn(keyed_server):
    start = core_start(keyed_server, API_KEY)
    assert start["start_method"] == "spawn" and ADMIN_API_KEY_ENV in start["reason"]
    assert start["engine_imported_in"] == "core"
    assert "torch" in start["heavy_modules_imported"]


def test_spawn_on_request_and_a_bad_method_named():
    assert choose_start_method({START_METHOD_ENV: "spawn"}) == StartChoice(
        "spawn", f"${START_METHOD_ENV}=spawn"
    )
    with pytest.raises(ValueError, match=START_METHOD_ENV):
        choose_start_method({START_METHOD_ENV: "forkserver"})


def test_exec_environment_names(tmp_path):
    block = tmp_path / "environ"
    block.write_bytes(b"A=1\0OMP_WAIT_POLICY=PASSIVE\0B=x=y\0")
    assert exec_environ_names(str(block)) == {"A", "OMP_WAIT_POLICY", "B"}
    assert exec_environ_names(str(tmp_path / "missing")) is None


def test_serve_names_a_bad_start_method(tiny_chat_model):
    env = os.environ | {START_METHOD_ENV: "fork-please"}
    command = [sys.executable, "-m", "radixserve.cli", "serve", tiny_chat_model]
    done = subprocess.run(command + ["--port", "1"], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert f"radixserve serve: ${START_METHOD_ENV} must be one of" in done.stderr


def test_serve_says_why_its_core_did_not_start(tiny_chat_model, tmp_path):
    """A flag the core refuses while it starts: one last line saying why, and exit code 1 (the
    core's traceback stays above it), not the pipe's EOFError."""
    command = [sys.executable, "-m", "radixserve.cli", "serve", tiny_chat_model, "--port", "1"]
    flags = ["--enable-hierarchical-cache", "--hicache-size", "10000000"]  # 10 PB in memory
    done = subprocess.run(command + flags, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("radixserve serve: engine core failed to start: ValueError: ")
    assert "--hicache-size 10000000.0: the host tier (" in last and "GiB free on cpu" in last
    assert "EOFError" not in done.stderr


class CoreThatFailsBetweenPollAndCheck:
    """A core process whose failure lands in the race window: it sends StartFailed and exits
    after the client's poll timed out and before the client asks whether it is alive."""

    exitcode = 1

    def __init__(self, child_end):
        self.child_end = child_end

    def is_alive(self) -> bool:
        self.child_end.send_bytes(encode(StartFailed(error="ValueError: --hicache-size too big")))
        self.child_end.close()
        return False

    def join(self, timeout=None) -> None:
        pass


def test_a_core_that_fails_as_the_poll_times_out_still_says_why():
    client = MultiprocessClient({})
    client._conn, child_end = multiprocessing.Pipe()
    client._process = CoreThatFailsBetweenPollAndCheck(child_end)
    with pytest.raises(EngineDeadError, match="failed to start: ValueError: --hicache-size"):
        client.wait_ready(timeout_s=5)


FORK_PROBE = """
import sys
import radixserve.cli  # the command line's imports: no torch, no OpenMP yet
from radixserve.client.core_start import choose_start_method, set_openmp_defaults
loaded_first = "{first}" == "torch"
if loaded_first:
    import torch
print(set_openmp_defaults(), "torch" in sys.modules)
import torch
print(choose_start_method())
"""


@pytest.mark.parametrize("first", ["cli", "torch"])
def test_serve_sets_openmp_before_torch_so_the_core_may_fork(first):
    env = {k: v for k, v in os.environ.items() if k not in CORE_ENV_DEFAULTS}
    probe = [sys.executable, "-c", FORK_PROBE.format(first=first)]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, check=True)
    read, choice = done.stdout.splitlines()
    if first == "cli":  # the defaults are set before OpenMP loads: it reads them, fork is safe
        assert read == "True False" and choice == "StartChoice(method='fork', reason='')"
    else:  # torch (and its OpenMP) loaded before: the defaults came too late
        assert read == "False True" and "OpenMP started without" in choice and "spawn" in choice


def test_the_early_tokenizer_is_used_only_when_it_is_the_cores():
    model = str(default_model_path())
    core = model_tokenizer(model)  # what the core opens: its path and vocabulary
    path, vocab = core.name_or_path, 49152
    early = EarlyTokenizer(model).result(path, vocab)
    assert early is not None and early.name_or_path == path
    assert early.encode("Hello, world") == core.encode("Hello, world")
    assert EarlyTokenizer(model).result(path + "-other", vocab) is None
    assert EarlyTokenizer(model).result(path, vocab + 1) is None
    # a model it cannot open: no error here (the core reports it), the server opens the core's
    assert EarlyTokenizer("/nonexistent/model.gguf").result(path, vocab) is None
