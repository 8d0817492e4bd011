"""Pieces of a streamed program's text (or of one variable) as they are generated.

Readers wait on the executor's condition, which every text or variable change notifies;
each piece is what was appended since the last one, so the pieces join to the final text.
"""

from __future__ import annotations

from collections.abc import Iterator

from radixserve.frontend_lang.executor import Executor


def iter_text(ex: Executor) -> Iterator[str]:
    """The program's whole text, piece by piece, until the program finishes."""
    pos = 0
    while True:
        with ex.changed:
            ex.changed.wait_for(lambda pos=pos: len(ex.text) > pos or ex.finished)
            piece, finished = ex.text[pos:], ex.finished
        if piece:
            pos += len(piece)
            yield piece
        if finished:
            return


def iter_var(ex: Executor, name: str) -> Iterator[str]:
    """Variable `name`'s text, piece by piece, until it is set (or the program ends)."""
    pos = 0
    while True:
        with ex.changed:
            ex.changed.wait_for(lambda pos=pos: _var_changed(ex, name, pos))
            text, done = _var_text(ex, name), name in ex.done_vars or ex.finished
        if text[pos:]:
            yield text[pos:]
            pos = len(text)
        if done:
            return


def _var_changed(ex: Executor, name: str, pos: int) -> bool:
    return len(_var_text(ex, name)) > pos or name in ex.done_vars or ex.finished


def _var_text(ex: Executor, name: str) -> str:
    """The final value if it is text, else the raw generated text so far."""
    value = ex.variables.get(name) if name in ex.done_vars else None
    return value if isinstance(value, str) else ex.stream_text.get(name, "")


def iter_var_chunks(ex: Executor, name: str) -> Iterator[tuple[str, dict | None]]:
    """Variable `name` as (new text, meta_info) per streamed chunk: each meta holds only the
    logprobs new in its chunk, as SGLang's streams do. A gen that was not streamed (or that
    ended before being read) gives its whole text and meta once."""
    pos = num = 0
    while True:
        with ex.changed:
            ex.changed.wait_for(lambda num=num: _chunks_changed(ex, name, num))
            chunks = ex.stream_chunks.get(name, [])[num:]
            done = name in ex.done_vars or ex.finished
        for text, meta in chunks:
            yield text[pos:], meta
            pos, num = len(text), num + 1
        if done and not chunks:
            if num == 0 and name in ex.done_vars:
                yield _var_text(ex, name), ex.meta_info.get(name)
            return


def _chunks_changed(ex: Executor, name: str, num: int) -> bool:
    return len(ex.stream_chunks.get(name, [])) > num or name in ex.done_vars or ex.finished
