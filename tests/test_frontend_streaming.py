"""Streaming programs: `run(stream=True)` returns at once; text_iter / text_async_iter yield
pieces that grow the text and end equal to the final text or variable."""

from __future__ import annotations

import asyncio
import threading

import pytest

import radixserve.frontend_lang as sgl
from radixserve.frontend_lang import EngineBackend

GREEDY = {"temperature": 0, "ignore_eos": True}


@sgl.function
def chat(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, **GREEDY))
    s += sgl.user("Shorter?")
    s += sgl.assistant(sgl.gen("short", max_tokens=3, **GREEDY))


def test_text_iter_of_a_variable_grows_to_its_final_value(backend):
    state = chat.run("Why is the sky blue?", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] == 8
    plain = chat.run("Why is the sky blue?", backend=backend)
    assert plain["answer"] == state["answer"] and plain.text() == state.text()


def test_text_iter_of_the_whole_text_ends_equal_to_text(backend):
    state = chat.run("Hello", backend=backend, stream=True)
    joined = ""
    for piece in state.text_iter():
        joined += piece
        assert state.executor.text.startswith(joined) or state.executor.finished
    assert joined == state.text()
    assert state.messages()[-1] == {"role": "assistant", "content": state["short"].lstrip()}


def test_text_async_iter(backend):
    async def collect():
        state = chat.run("Hi there", backend=backend, stream=True)
        pieces = [p async for p in state.text_async_iter("answer")]
        pairs = [p async for p in state.text_async_iter("short", return_meta_data=True)]
        return state, pieces, pairs

    state, pieces, pairs = asyncio.run(collect())
    assert "".join(pieces) == state["answer"]
    assert "".join(p for p, _ in pairs) == state["short"]
    assert pairs[-1][1]["completion_tokens"] == 3


def test_non_streamed_state_iterates_once(backend):
    state = chat.run("Once", backend=backend)
    assert list(state.text_iter()) == [state.text()]
    assert list(state.text_iter("short")) == [state["short"]]


def test_concurrent_streams_each_see_their_final_output(engine):
    """Several streamed programs step the same engine from different threads; each must
    still end with its complete output."""
    backend = EngineBackend(engine)
    states = [chat.run(f"Question {i}", backend=backend, stream=True) for i in range(4)]
    results: dict[int, str] = {}

    def drain(i: int) -> None:
        results[i] = "".join(states[i].text_iter("answer"))

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, state in enumerate(states):
        assert results[i] == state["answer"]
        assert state.get_meta_info("answer")["finish_reason"]["type"] == "length"
        assert state.get_meta_info("short")["completion_tokens"] == 3


def test_an_error_in_a_streamed_program_surfaces_to_the_reader(backend):
    @sgl.function
    def broken(s):
        s += "Hi" + sgl.gen("x", max_tokens=2, **GREEDY)
        s += sgl.user_end()

    state = broken.run(backend=backend, stream=True)
    with pytest.raises(ValueError, match="role 'user' ends"):
        list(state.text_iter())
    assert isinstance(state.error(), ValueError)


@sgl.function
def scored(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, return_logprob=True, top_logprobs_num=2,
                               **GREEDY))  # fmt: skip


def test_text_async_iter_meta_carries_each_chunks_logprobs(backend):
    """SGLang's contract: each (piece, meta) holds the logprobs new in that chunk, and
    output_token_logprobs_length counts them all; the variable's meta holds them all."""

    async def collect():
        state = scored.run("Why?", backend=backend, stream=True)
        return state, [p async for p in state.text_async_iter("answer", return_meta_data=True)]

    state, pairs = asyncio.run(collect())
    assert len(pairs) > 1 and "".join(p for p, _ in pairs) == state["answer"]
    whole = state.get_meta_info("answer")
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert [e for _, meta in pairs for e in meta[key]] == whole[key]
    assert len(whole["output_token_logprobs"]) == 6
    for _, meta in pairs:
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
    plain = scored.run("Why?", backend=backend).get_meta_info("answer")
    assert [e[:2] for e in plain["output_token_logprobs"]] == [
        e[:2] for e in whole["output_token_logprobs"]
    ]
