"""NGRAM drafting (prompt lookup): the tokens that followed an earlier occurrence of the
sequence's last n tokens, n tried from the longest window down.

Two sources, in order: the request's own prompt + output (answers that quote a tool output,
code edits, lists), then an `NgramStore` of recently finished requests, so requests sharing
a vocabulary (agents calling the same tools) help each other.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Drafter

STORE_INDEX_TOKENS = 1024
"""Tokens at the end of a finished request that the store indexes: bounds the work done
when a request finishes (one dict entry per token and window size)."""


def match_suffix(seq: np.ndarray, min_window: int, max_window: int, num: int) -> list[int]:
    """The `num` tokens after the latest earlier occurrence of the longest suffix of `seq`
    of `min_window..max_window` tokens; [] when none occurs. Vectorized over candidates."""
    last = len(seq) - 1
    if last < min_window:
        return []
    ends = np.flatnonzero(seq[:last] == seq[last])  # candidate occurrences, by their last token
    if ends.size == 0:
        return []
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_window, last)):
        pos = ends - back
        alive &= (pos >= 0) & (seq[np.maximum(pos, 0)] == seq[last - back])
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    if best < min_window:
        return []
    end = int(ends[np.flatnonzero(lengths == best)[-1]])
    return seq[end + 1 : end + 1 + num].tolist()


class NgramStore:
    """n-gram -> the tokens that followed it last, per cache namespace; least recently used
    entries go beyond `capacity`."""

    def __init__(self, capacity: int, min_window: int, max_window: int, num: int):
        self.capacity = capacity
        self.windows = range(max_window, min_window - 1, -1)  # longest first
        self.num = num
        self._entries: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, namespace: str | None, seq: list[int]) -> None:
        """Indexes the last STORE_INDEX_TOKENS tokens of `seq`; later occurrences win."""
        tail = seq[-STORE_INDEX_TOKENS:]
        entries = self._entries
        for start in range(len(tail) - 1):
            for n in self.windows:
                end = start + n
                if end < len(tail):
                    key = (namespace, *tail[start:end])
                    entries[key] = tuple(tail[end : end + self.num])
                    entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def lookup(self, namespace: str | None, seq: list[int]) -> list[int]:
        """What followed the longest window of `seq`'s suffix that the store has seen."""
        for n in self.windows:
            if n <= len(seq):
                key = (namespace, *seq[-n:])
                found = self._entries.get(key)
                if found is not None:
                    self._entries.move_to_end(key)
                    return list(found)
        return []


class NgramDrafter(Drafter):
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, capacity: int):
        self.num_draft_tokens = num_draft_tokens
        self.min_window, self.max_window = min_window, max_window
        self.store = NgramStore(capacity, min_window, max_window, num_draft_tokens)

    def propose(self, req: Req) -> list[int]:
        seq = req.seq_ids()
        array = np.asarray(seq, dtype=np.int64)
        own = match_suffix(array, self.min_window, self.max_window, self.num_draft_tokens)
        return own or self.store.lookup(req.namespace, seq)

    def on_finished(self, req: Req) -> None:
        self.store.add(req.namespace, req.seq_ids())
