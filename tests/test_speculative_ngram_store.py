"""The n-gram drafter's lookup: suffix matching, the store's hashes, and its bounded,
least-recently-used, per-namespace store."""

from __future__ import annotations

import numpy as np

from radixserve.engine.speculative.ngram import (
    NgramStore,
    match_suffix,
    suffix_hashes,
    window_hashes,
)


def test_match_suffix_prefers_the_longest_then_the_latest_match():
    seq = np.array([5, 1, 2, 9, 7, 1, 2, 3, 4, 8, 2, 3, 1, 2, 3])
    assert match_suffix(seq, 1, 4, 2) == [4, 8]  # [1, 2, 3] at 5..7 beats [2, 3] at 10..11
    assert match_suffix(seq, 1, 2, 3) == [1, 2, 3]  # windows <= 2: the latest [2, 3]
    assert match_suffix(seq, 4, 6, 2) == []
    assert match_suffix(np.array([7, 7, 7]), 1, 3, 4) == [7]


def test_store_hashes_agree_between_indexing_and_lookup():
    seq = [7, 3, 9, 3, 1]
    keys = suffix_hashes(seq, salt=12345)
    for n, hashes in window_hashes(np.array(seq), len(seq), salt=12345):
        assert keys[n - 1] == int(hashes[-1])


def test_ngram_store_is_bounded_lru_and_per_namespace():
    store = NgramStore(capacity=60, min_window=1, max_window=3, num=2)
    seqs = [[base + i for i in range(6)] for base in range(100, 700, 100)]  # 12 n-grams each
    for seq in seqs[:5]:
        store.add(None, seq)
    assert store.lookup(None, [9, 101, 102]) == [103, 104]  # the first is now the newest used
    assert store.lookup("other", [9, 101, 102]) == []
    store.add(None, seqs[5])  # past the capacity: the least recently used sequences go
    assert len(store) <= 60
    assert store.lookup(None, [101]) == [102, 103] and store.lookup(None, [603]) == [604, 605]
    assert store.lookup(None, [201]) == [] and store.lookup(None, [501]) == []
    store.add(None, list(range(1000, 1100)))  # longer than the capacity allows: its end only
    assert len(store) <= 60 and store.lookup(None, [1097]) == [1098, 1099]
