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
