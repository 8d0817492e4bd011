"""SGLang's own frontend client (`sglang.RuntimeEndpoint`) runs real programs against
`radixserve serve`: gen, select, fork + gather, fork + concate_and_append (parallel
encoding), run_batch and streaming. Every generated value is checked against a plain greedy
`/generate` of the same text, so the client and the server agree token for token.

Needs `sglang` importable. Its wheel's requirements pin a CUDA torch, so it is installed
without them (`import sglang` still imports torch, triton and transformers, which radixserve
already brings), plus the few modules it needs that radixserve does not:
    pip install --no-deps sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 \
        pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1
The programs (sglang_client_programs.py) run in a subprocess, because
`import sglang` patches transformers and sets environment variables for its whole process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (see this file's docstring for the --no-deps install line)",
)

PROGRAMS = Path(__file__).with_name("sglang_client_programs.py")
SUBPROCESS_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def results(server) -> dict:
    """Each program's result, from one run of sglang_client_programs.py against `server`."""
    proc = subprocess.run([sys.executable, str(PROGRAMS), server.url], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=PROGRAMS.parent)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1])
    if "import_error" in report:
        pytest.skip(f"sglang is installed but not importable: {report['import_error']}")
    return report["results"]


def ok(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, f"{name}: {result['error']}"
    return result


def greedy_text(endpoint, text: str, max_new_tokens: int) -> str:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new_tokens}
    return endpoint.request({"text": text, "sampling_params": params})["text"]


def test_gen(results, endpoint):
    result = ok(results, "gen")
    prompt = "The capital of France is"
    assert result["out"] == greedy_text(endpoint, prompt, 6)
    assert result["text"] == prompt + result["out"]
    assert result["meta"]["completion_tokens"] == 6


def test_select_agrees_with_radixserves_frontend(results, endpoint):
    import radixserve.frontend_lang as sgl

    @sgl.function
    def choose(s):
        s += "The best color is"
        s += sgl.select("color", choices=[" red", " green", " blue"])

    result = ok(results, "select")
    assert result["color"] == choose.run(backend=endpoint)["color"]
    assert result["text"] == "The best color is" + result["color"]


def test_fork_join_gather_variable(results):
    result = ok(results, "gather")
    assert len(result["tip"]) == 2 and all(isinstance(t, str) and t for t in result["tip"])
    assert result["text"].endswith("Tips:")  # gather brings back variables, not text


def test_fork_join_concate_and_append_finishes_with_the_joined_text(results, endpoint):
    """The client joins the texts and posts /concate_and_append_request; the next gen is the
    exact continuation of the joined text."""
    result = ok(results, "parallel_encoding")
    preamble, forks = result["preamble"], result["forks"]
    assert all(f.startswith(preamble + f"Document {i}: ") for i, f in enumerate(forks))
    joined = preamble + "".join(f[len(preamble) :] for f in forks) + "Answer:"
    assert result["text"] == joined + result["answer"]
    assert result["answer"] == greedy_text(endpoint, joined, 4)


def test_run_batch(results, endpoint):
    result = ok(results, "run_batch")
    assert result["outs"] == [greedy_text(endpoint, p, 6) for p in result["prompts"]]


def test_streaming(results):
    result = ok(results, "stream")
    assert len(result["pieces"]) > 1 and "".join(result["pieces"]) == result["text"]
    assert len(result["var_pieces"]) > 1 and "".join(result["var_pieces"]) == result["out"]
    assert result["text"] == "Once upon a time" + result["out"]
