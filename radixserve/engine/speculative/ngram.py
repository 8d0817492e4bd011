"""NGRAM drafting (prompt lookup): the tokens that followed an earlier occurrence of the
sequence's last n tokens, n tried from the longest window down.

Two sources, in order: the request's own prompt + output (answers that quote a tool output,
code edits, lists), then an `NgramStore` of recently finished requests, so requests sharing
a vocabulary (agents calling the same tools) help each other.
"""

from __future__ import annotations

import numpy as np

from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Drafter, SequenceArrays

STORE_INDEX_TOKENS = 1024
"""Most tokens at the end of a finished request that the store indexes (its work per
request); fewer when the capacity could not hold that many."""
_HASH_MULTIPLIER = 0x100000001B3  # FNV-64's prime: n-gram keys are polynomial hashes
_MASK64 = (1 << 64) - 1
_POSITION_BITS = 32  # an index value packs (sequence id << 32) | end position


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


def window_hashes(seq: np.ndarray, max_window: int, salt: int):
    """Yields (n, hashes) for n = 1..max_window: hashes[i] keys seq[i : i + n] (int64,
    wrapping arithmetic; the salt separates namespaces)."""
    hashes = np.full(len(seq), salt, dtype=np.int64)
    for n in range(1, min(max_window, len(seq)) + 1):
        hashes = hashes[: len(seq) - n + 1] * _HASH_MULTIPLIER + seq[n - 1 :]
        yield n, hashes


def suffix_hashes(tail: list[int], salt: int) -> list[int]:
    """`window_hashes`' keys of the suffixes of `tail`, shortest first, in plain Python (a
    lookup hashes a dozen tokens: cheaper than numpy's per-call cost)."""
    keys, value, power = [], salt, 1  # value: the hash of the suffix so far; power: M^n
    for token in reversed(tail):
        value = (value + (salt * (_HASH_MULTIPLIER - 1) + token) * power) & _MASK64
        power = power * _HASH_MULTIPLIER & _MASK64
        keys.append(value - (1 << 64) if value >= 1 << 63 else value)
    return keys


class NgramStore:
    """n-gram -> where it was last followed by something, over recently finished sequences.

    The index maps an n-gram's hash to (sequence id, end); the sequences are kept in order of
    last use (added or drafted from). Past `capacity` index entries, the least recently used
    sequences go and the index is rebuilt
    from the rest (amortized: at most once per capacity / 2 entries added). A lookup checks
    the tokens themselves, so a hash collision costs a miss, never a wrong draft.
    """

    def __init__(self, capacity: int, min_window: int, max_window: int, num: int):
        self.capacity = capacity
        self.min_window, self.max_window, self.num = min_window, max_window, num
        self._seqs: dict[int, np.ndarray] = {}  # least recently used first
        self._index: dict[int, int] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._index)

    def add(self, namespace: str | None, seq: list[int]) -> None:
        """Indexes the end of `seq` (STORE_INDEX_TOKENS at most); later occurrences win."""
        num_windows = self.max_window - self.min_window + 1
        num = max(min(STORE_INDEX_TOKENS, self.capacity // num_windows), 2)
        tail = np.asarray(seq[-num:], dtype=np.int64)
        if len(tail) < 2:
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._seqs[seq_id] = tail
        self._index_seq(seq_id, tail, _salt(namespace))
        if len(self._index) > self.capacity:
            self._shrink()

    def lookup(self, namespace: str | None, seq: list[int]) -> list[int]:
        """What followed the longest window of `seq`'s suffix that the store has seen."""
        tail = seq[-self.max_window :]
        keys = suffix_hashes(tail, _salt(namespace))
        for n in range(len(tail), self.min_window - 1, -1):
            value = self._index.get(keys[n - 1])
            if value is None:
                continue
            seq_id, end = value >> _POSITION_BITS, value & ((1 << _POSITION_BITS) - 1)
            stored = self._seqs.get(seq_id)
            if stored is not None and stored[end - n : end].tolist() == tail[-n:]:
                self._seqs[seq_id] = self._seqs.pop(seq_id)  # most recently used: kept longest
                return stored[end : end + self.num].tolist()
        return []

    def _index_seq(self, seq_id: int, tail: np.ndarray, salt: int) -> None:
        base = seq_id << _POSITION_BITS
        for n, hashes in window_hashes(tail[:-1], self.max_window, salt):
            if n >= self.min_window:  # window i .. i + n - 1 is followed by tail[i + n]
                ends = np.arange(n, n + len(hashes), dtype=np.int64)
                self._index.update(zip(hashes.tolist(), (base + ends).tolist()))

    def _shrink(self) -> None:
        """Drops the least recently used sequences until the rest hold about half the
        capacity."""
        per_seq = len(self._index) / max(len(self._seqs), 1)
        keep = max(int(self.capacity / 2 / max(per_seq, 1)), 1)
        for seq_id in list(self._seqs)[:-keep]:
            del self._seqs[seq_id]
        self._index = {k: v for k, v in self._index.items() if v >> _POSITION_BITS in self._seqs}


def _salt(namespace: str | None) -> int:
    """A per-namespace start value for the hashes (stable within the process)."""
    return hash(namespace) & 0x7FFFFFFFFFFFFFFF


class NgramDrafter(Drafter):
    algorithm = "NGRAM"

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, capacity: int):
        self.num_draft_tokens = num_draft_tokens
        self.min_window, self.max_window = min_window, max_window
        self.store = NgramStore(capacity, min_window, max_window, num_draft_tokens)
        self._arrays = SequenceArrays()

    def propose(self, req: Req) -> list[int]:
        seq = self._arrays.get(req)
        own = match_suffix(seq, self.min_window, self.max_window, self.num_draft_tokens)
        return own or self.store.lookup(req.namespace, seq[-self.max_window :].tolist())

    def on_finished(self, req: Req) -> None:
        self.store.add(req.namespace, req.seq_ids())
        self._arrays.forget(req)
