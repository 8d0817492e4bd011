"""Suffix-tree speculation over a token array, computed from the occurrences themselves.

A suffix tree of depth D over a sequence has one node per substring of at most D tokens;
a node's count is how many times its substring occurs, a child's share of that count is the
empirical probability of the next token. Walking the tree for a context's last m tokens is
the same as taking every occurrence of those m tokens and reading what followed them, so
this module keeps no tree: it finds the occurrences of the context's last token (numpy),
extends them backwards to measure each one's match length, and walks forward from the
occurrences that match at least m tokens, always to the most frequent next token:

    context  ... x y z          occurrences of z that match "y z": a, b, c
    seq      .. y z q ..  .. y z q ..  .. y z r      ->  q with p = 2/3, then what follows
                                                        q at a, b, and so on

SuffixDecoding's rule (arXiv 2411.04975; arctic-inference's `SuffixTree.speculate` has the
same semantics): for each match length m = 1 .. min(D, len(context)) - 1, draft at most
floor(max_spec_factor * m) tokens (and the tree's depth: m + drafted <= D), stop before a
token whose cumulative probability falls below min_token_prob, and keep the draft with the
highest score (the sum of its tokens' cumulative probabilities; ties: the longer match).
A sequence that ends right after a match counts in the denominator (the pattern was
followed by nothing), as a tree's node count does. The frequencies are counted over the
latest MAX_OCCURRENCES occurrences of the context's last token (a bound on a lookup's work;
a tree counts all). Negative values in `seq` separate
sequences: no match or draft crosses them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

_EPSILON = 1e-6  # floor(m * factor) as arctic-inference rounds it: 0.1 * 30 counts as 3
_BINCOUNT_MIN = 256  # larger occurrence sets are counted with bincount, smaller with unique
_PYTHON_MAX = 32  # and sets this small in plain Python
# 1024: the work of one lookup stays a few milliseconds however often the last token
# occurs (a separator or a newline in thousands of stored outputs)
MAX_OCCURRENCES = 1024
"""Most occurrences of the context's last token a lookup considers: the latest ones."""


@dataclass(frozen=True)
class SuffixLimits:
    """What bounds a draft (SGLang's --speculative-suffix-* flags and the draft cap K)."""

    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    max_spec_tokens: int

    def num_tokens(self, match_len: int) -> int:
        """Most tokens drafted after a match of `match_len` tokens."""
        by_factor = int(match_len * self.max_spec_factor + _EPSILON)
        return max(min(self.max_spec_tokens, by_factor, self.max_tree_depth - match_len), 0)


@dataclass(frozen=True)
class SuffixDraft:
    """A drafted path: its tokens, each one's estimated (cumulative) probability, the score
    (their sum), the match length it came from and where in `seq` its last token was read
    from (`ends`: one position per supporting occurrence)."""

    tokens: list[int]
    probs: list[float]
    score: float = 0.0
    match_len: int = 0
    ends: np.ndarray | None = None


NO_DRAFT = SuffixDraft([], [])


def speculate(
    seq: np.ndarray, num_positions: int, context: np.ndarray, limits: SuffixLimits
) -> SuffixDraft:
    """The best draft to follow `context` from the occurrences in `seq[:num_positions]`
    (a request's own sequence leaves its last position out: the context itself)."""
    context = context[-limits.max_tree_depth :]
    max_match = len(context) - 1
    if max_match < 1 or num_positions < 1:
        return NO_DRAFT
    ends = np.flatnonzero(seq[:num_positions] == context[-1])[-MAX_OCCURRENCES:]
    if ends.size == 0:
        return NO_DRAFT
    lengths = match_lengths(seq, ends, context, max_match)
    highs = np.unique(lengths).tolist()  # match lengths in (low, high] share occurrences
    ranges = list(zip([0, *highs[:-1]], highs))
    # the ranges that may draft most first (a longer match first among equals), so that
    # fewer walks are needed: a range whose token bound cannot beat the best is skipped
    ranges.sort(key=lambda r: (_range_bound(r, limits), r[1]), reverse=True)
    best = NO_DRAFT
    for low, high in ranges:
        best = _best_in_range(seq, ends[lengths >= high], low, high, limits, best)
    return best


def _range_bound(bounds: tuple[int, int], limits: SuffixLimits) -> int:
    """Most tokens any match length in (low, high] may draft."""
    low, high = bounds
    return max(limits.num_tokens(m) for m in range(low + 1, high + 1))


def match_lengths(
    seq: np.ndarray, ends: np.ndarray, context: np.ndarray, max_match: int
) -> np.ndarray:
    """For each occurrence `ends[i]` of the context's last token, how many of the
    context's last tokens (at most `max_match`) end there."""
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.arange(ends.size)  # occurrences still matching, shrunk as they stop
    for back in range(1, max_match):
        pos = ends[alive] - back
        ok = pos >= 0
        ok[ok] = seq[pos[ok]] == context[-1 - back]
        alive = alive[ok]
        if alive.size == 0:
            break
        lengths[alive] += 1
    return lengths


def _best_in_range(
    seq: np.ndarray,
    ends: np.ndarray,
    low: int,
    high: int,
    limits: SuffixLimits,
    best: SuffixDraft,
) -> SuffixDraft:
    """The best of `best` and the drafts for match lengths low + 1 .. high, which all walk
    from the same occurrences `ends` (only their length limits differ); on equal scores
    the longer match wins. Skipped when even all-certain tokens could not beat `best`."""
    num = _range_bound((low, high), limits)
    if not _may_beat(num, high, best):
        return best
    path = walk(seq, ends, num, limits.min_token_prob)
    cumulative = np.cumsum([0.0, *path.probs])
    for m in range(low + 1, high + 1):
        keep = min(limits.num_tokens(m), len(path.tokens))
        if keep and _may_beat(float(cumulative[keep]), m, best):
            best = SuffixDraft(
                path.tokens[:keep], path.probs[:keep], float(cumulative[keep]), m, path.ends
            )
    return best


def _may_beat(score: float, match_len: int, best: SuffixDraft) -> bool:
    return score > best.score or (score == best.score and match_len > best.match_len)


def walk(seq: np.ndarray, ends: np.ndarray, num: int, min_token_prob: float) -> SuffixDraft:
    """Up to `num` tokens after the occurrences ending at `ends`, each the most frequent
    continuation of those that continue the path so far (ties: the smallest token id)."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < num:
        if ends.size == 1:  # one occurrence: what follows it, at the same probability
            return _single(seq, int(ends[0]), num, prob, min_token_prob, tokens, probs)
        following = ends + 1  # ascending, as `ends` always is: only the last may fall off
        if following[-1] >= len(seq):
            following = following[:-1]
        nxt = seq[following]
        valid = nxt[nxt >= 0]
        if valid.size == 0:
            break
        token, count = _most_frequent(valid)
        prob *= count / ends.size
        if prob < min_token_prob:
            break
        tokens.append(token)
        probs.append(prob)
        ends = following[nxt == token]  # a separator (< 0) never equals a token
    return SuffixDraft(tokens, probs, float(sum(probs)), 0, ends)


def _single(
    seq: np.ndarray,
    end: int,
    num: int,
    prob: float,
    min_token_prob: float,
    tokens: list[int],
    probs: list[float],
) -> SuffixDraft:
    """`walk`'s rest from a single occurrence ending at `end` (up to a separator)."""
    if prob >= min_token_prob:
        rest = seq[end + 1 : end + 1 + num - len(tokens)].tolist()
        for token in rest:
            if token < 0:
                break
            tokens.append(token)
            probs.append(prob)
            end += 1
    return SuffixDraft(tokens, probs, float(sum(probs)), 0, np.array([end]))


def _most_frequent(values: np.ndarray) -> tuple[int, int]:
    """The most frequent value of a non-negative array and its count."""
    if values.size > _PYTHON_MAX:  # repeated outputs mostly agree: a strict majority is
        for candidate in (int(values[0]), int(values[-1])):  # the answer, found in O(n)
            count = int(np.count_nonzero(values == candidate))
            if 2 * count > values.size:
                return candidate, count
    if values.size >= _BINCOUNT_MIN:
        counts = np.bincount(values)
        token = int(counts.argmax())
        return token, int(counts[token])
    if values.size <= _PYTHON_MAX:  # numpy's per-call cost dominates small arrays
        counted = Counter(values.tolist())
        token = min(counted, key=lambda t: (-counted[t], t))
        return token, counted[token]
    unique, counts = np.unique(values, return_counts=True)
    index = int(counts.argmax())
    return int(unique[index]), int(counts[index])
