"""SGLang frontend programs run with SGLang's own client (`import sglang as sgl`) against a
server: `python sglang_client_programs.py URL` prints one JSON object, program -> result.

It runs in its own process because `import sglang` monkey-patches transformers and sets
cache environment variables, which must not leak into the rest of the test session. Each
program runs on a thread with a deadline, so one that hangs (the client waits forever on a
failed request) is reported as {"error": "timeout"} instead of stalling the others.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

try:
    import sglang as sgl
except ImportError as exc:  # installed without a dependency its import needs
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)

GREEDY = {"temperature": 0, "ignore_eos": True}
DEADLINE_S = 60.0
PREAMBLE = "You are a careful assistant who answers in one short sentence. " * 3


@sgl.function
def complete(s, prompt):
    s += prompt + sgl.gen("out", max_tokens=6, **GREEDY)


@sgl.function
def complete_streamed(s, prompt):
    # 32 tokens: SGLang's text_iter joins the pieces that arrived while its reader slept, so a
    # 6-token stream could reach a starved reader (a loaded machine) as one piece
    s += prompt + sgl.gen("out", max_tokens=32, **GREEDY)


@sgl.function
def choose(s):
    s += "The best color is"
    s += sgl.select("color", choices=[" red", " green", " blue"])


@sgl.function
def gather(s):
    s += PREAMBLE + "Tips:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" tip {i}:" + sgl.gen("tip", max_tokens=3, **GREEDY)
    forks.join()


@sgl.function
def parallel_encoding(s):
    """Encode two documents in parallel from a shared preamble, then answer over both."""
    s += PREAMBLE
    forks = s.fork(2)
    forks += lambda i: f"Document {i}: " + sgl.gen("doc", max_tokens=4, **GREEDY) + "\n"
    s.set_var("fork_texts", [f.text() for f in forks])
    forks.join(mode="concate_and_append")
    s += "Answer:" + sgl.gen("answer", max_tokens=4, **GREEDY)


def run_gen() -> dict[str, Any]:
    state = complete.run(prompt="The capital of France is")
    return {"text": state.text(), "out": state["out"], "meta": state.get_meta_info("out")}


def run_select() -> dict[str, Any]:
    state = choose.run()
    return {"text": state.text(), "color": state["color"]}


def run_gather() -> dict[str, Any]:
    state = gather.run()
    return {"text": state.text(), "tip": state["tip"]}


def run_parallel_encoding() -> dict[str, Any]:
    state = parallel_encoding.run()
    return {"preamble": PREAMBLE, "text": state.text(), "forks": state["fork_texts"],
            "answer": state["answer"]}  # fmt: skip


def run_batch() -> dict[str, Any]:
    prompts = [f"Item {i} is" for i in range(3)]
    states = complete.run_batch([{"prompt": p} for p in prompts], num_threads=3)
    return {"prompts": prompts, "outs": [s["out"] for s in states]}


def run_stream() -> dict[str, Any]:
    state = complete_streamed.run(prompt="Once upon a time", stream=True)
    pieces = list(state.text_iter())
    var_state = complete_streamed.run(prompt="Once upon a time", stream=True)
    var_pieces = list(var_state.text_iter("out"))
    return {"pieces": pieces, "text": state.text(), "var_pieces": var_pieces,
            "out": var_state["out"]}  # fmt: skip


PROGRAMS: dict[str, Callable[[], dict[str, Any]]] = {
    "gen": run_gen,
    "select": run_select,
    "gather": run_gather,
    "parallel_encoding": run_parallel_encoding,
    "run_batch": run_batch,
    "stream": run_stream,
}


def run_with_deadline(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {"error": "timeout"}

    def target() -> None:
        nonlocal result
        try:
            result = fn()
        except Exception:
            result = {"error": traceback.format_exc()}

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    return result


def main(url: str) -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    results = {name: run_with_deadline(fn) for name, fn in PROGRAMS.items()}
    print(json.dumps({"sglang_version": sgl.__version__, "results": results}))
    sys.stdout.flush()
    os._exit(0)  # a hung program's client threads are not daemons


if __name__ == "__main__":
    main(sys.argv[1])
