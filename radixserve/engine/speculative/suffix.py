"""SUFFIX drafting (SuffixDecoding, arXiv 2411.04975): drafts from a suffix tree over the
outputs of recent requests and one over the request's own prompt + output, the draft's
length adapting to how long the match is and how often what follows it occurred there
(suffix_match.py has the rule).

    request's own sequence  ---- speculate ----\\
                                                >-- the higher score (own on a tie)
    SuffixStore[namespace]  ---- speculate ----/    (outputs of finished requests)

The store holds finished requests' outputs per cache namespace (a tenant never drafts from
another's outputs), bounded in requests and in tokens; past either bound the least recently
used outputs (added or drafted from) go, whole. Each namespace's outputs are one array
joined by separators, rebuilt when its outputs changed since the last lookup.

Why our own and not arctic-inference's C++ `SuffixTree` (what SGLang and vLLM import): its
tree builds (27 s, nanobind + cmake) and runs on CPU without vLLM, and drafts alike (a
randomized comparison agreed on all tie-free cases up to float32 rounding), but 0.3.0 is an
sdist whose build requires torch >= 2.10, protobuf and grpcio-tools in the build
environment (an isolated build downloads a CUDA torch), its cache evicts FIFO rather than
LRU and knows neither namespaces nor a token bound. Occurrence counting in numpy gives the
same drafts with no build step; a lookup costs O(tokens stored in the namespace) for the
first comparison, which the token bound keeps small (benchmarks/suffix_lookup.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Drafter, SequenceArrays
from radixserve.engine.speculative.suffix_match import (
    NO_DRAFT,
    SuffixDraft,
    SuffixLimits,
    speculate,
)

SEPARATOR = -1  # between the outputs joined into a namespace's array: no match crosses it


@dataclass
class _Namespace:
    """One namespace's outputs: ids in the store's LRU, and their joined array (built
    lazily: None after a change)."""

    seq_ids: set[int] = field(default_factory=set)
    joined: np.ndarray | None = None
    starts: np.ndarray | None = None  # where each output begins in `joined`
    order: list[int] = field(default_factory=list)  # the output id at each start


class SuffixStore:
    """Outputs of finished requests, per namespace, for suffix speculation."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._outputs: OrderedDict[int, tuple[str | None, np.ndarray]] = OrderedDict()
        self._namespaces: dict[str | None, _Namespace] = {}
        self._num_tokens = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, namespace: str | None, output_ids: list[int]) -> None:
        """Stores one finished request's output (its last `max_tokens` at most)."""
        if self.max_requests == 0 or len(output_ids) < 2:
            return
        tokens = np.asarray(output_ids[-self.max_tokens :], dtype=np.int64)
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._outputs[seq_id] = (namespace, tokens)
        space = self._namespaces.setdefault(namespace, _Namespace())
        space.seq_ids.add(seq_id)
        space.joined = None
        self._num_tokens += len(tokens)
        while len(self._outputs) > self.max_requests or self._num_tokens > self.max_tokens:
            self._evict_oldest()

    def speculate(
        self, namespace: str | None, context: np.ndarray, limits: SuffixLimits
    ) -> SuffixDraft:
        """The best draft from the namespace's outputs."""
        space = self._namespaces.get(namespace)
        if space is None:
            return NO_DRAFT
        joined = self._joined(space)
        return speculate(joined, len(joined), context, limits)

    def mark_used(self, namespace: str | None, draft: SuffixDraft) -> None:
        """The outputs `draft` (just returned by `speculate`) was read from become the most
        recently used."""
        space = self._namespaces.get(namespace)
        if space is None or space.joined is None or draft.ends is None:
            return
        owners = np.searchsorted(space.starts, draft.ends, side="right") - 1
        for index in np.unique(owners).tolist():
            self._outputs.move_to_end(space.order[index])

    def _joined(self, space: _Namespace) -> np.ndarray:
        if space.joined is None:
            space.order = sorted(space.seq_ids)  # oldest first: the latest occurrences last
            parts = [self._outputs[i][1] for i in space.order]
            lengths = np.array([len(p) + 1 for p in parts], dtype=np.int64)
            space.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 1
            separator = np.array([SEPARATOR], dtype=np.int64)
            space.joined = np.concatenate([separator] + [x for p in parts for x in (p, separator)])
        return space.joined

    def _evict_oldest(self) -> None:
        seq_id, (namespace, tokens) = self._outputs.popitem(last=False)
        self._num_tokens -= len(tokens)
        space = self._namespaces[namespace]
        space.seq_ids.discard(seq_id)
        space.joined = None
        if not space.seq_ids:
            del self._namespaces[namespace]  # an empty namespace holds nothing


class SuffixDrafter(Drafter):
    """SUFFIX: the request's own sequence and the store of finished outputs."""

    algorithm = "SUFFIX"

    def __init__(
        self,
        num_draft_tokens: int,
        max_tree_depth: int,
        max_spec_factor: float,
        min_token_prob: float,
        max_cached_requests: int,
        max_cached_tokens: int,
    ):
        self.num_draft_tokens = num_draft_tokens
        self.limits = SuffixLimits(
            max_tree_depth, max_spec_factor, min_token_prob, num_draft_tokens
        )
        self.store = SuffixStore(max_cached_requests, max_cached_tokens)
        self._arrays = SequenceArrays()

    def propose(self, req: Req) -> list[int]:
        return self.speculate(req).tokens

    def speculate(self, req: Req) -> SuffixDraft:
        """The better of the own-sequence and the store's draft (own on a tie)."""
        seq = self._arrays.get(req)
        context = seq[-self.limits.max_tree_depth :]
        own = speculate(seq, len(seq) - 1, context, self.limits)
        stored = self.store.speculate(req.namespace, context, self.limits)
        if own.score >= stored.score:
            return own
        self.store.mark_used(req.namespace, stored)
        return stored

    def on_finished(self, req: Req) -> None:
        self.store.add(req.namespace, req.output_ids)

    def release(self, req: Req) -> None:
        self._arrays.forget(req)
