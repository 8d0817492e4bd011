"""Drafter: the seam every speculative algorithm plugs into. A drafter proposes tokens that
a request's sequence may continue with; the target model verifies them in the running batch
(verifier.py), so a bad draft costs compute but never changes the output."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.engine.request import Req
from radixserve.model.runner import LogitsOutput


@dataclass
class Draft:
    """Proposed tokens and, for a sampled draft, the distribution q each was drawn from
    (`probs` [len(tokens), vocab]); None: deterministic (q one-hot on each token)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    """A draft tree (EAGLE3 with --speculative-eagle-topk > 1; deterministic, probs None):
    node 0 is the request's last token, node j >= 1 is tokens[j - 1] and follows node
    parents[j - 1] (< j). None: a chain (each token follows the one before)."""
    source: str | None = None  # the algorithm that proposed it (AUTO's pick); None: the drafter's

    def cut(self, num: int) -> Draft:
        """The first `num` tokens (with their rows of q); of a tree, the nodes of depth at
        most `num`."""
        if self.parents is None:
            probs = None if self.probs is None else self.probs[:num]
            return Draft(self.tokens[:num], probs, source=self.source)
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return self.keep([d <= num for d in depth[1:]])

    def keep(self, wanted: list[bool]) -> Draft:
        """A tree's nodes j >= 1 with wanted[j - 1] whose ancestors are all kept."""
        new_index, tokens, parents = [0], [], []
        for token, parent, want in zip(self.tokens, self.parents, wanted):
            keep = want and new_index[parent] >= 0
            new_index.append(len(tokens) + 1 if keep else -1)
            if keep:
                tokens.append(token)
                parents.append(new_index[parent])
        return Draft(tokens, None, parents, self.source)

    def paths(self) -> list[list[int]]:
        """A tree's tokens from the root to each node j >= 1 (paths()[j - 1])."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.tokens, self.parents):
            paths.append(paths[parent] + [token])
        return paths[1:]


class Drafter(ABC):
    """Proposes draft tokens for decoding requests: NGRAM (lookup), SELF and STANDALONE
    (a draft model: model_drafter.py), EAGLE3 (a head over the target's hidden states),
    AUTO (auto.py: one of the others per request)."""

    num_draft_tokens: int  # K: the most tokens a proposal holds
    algorithm: str = "custom"  # what meta_info names its drafts by (custom: tests, benchmarks)

    @abstractmethod
    def propose(self, req: Req) -> list[int]:
        """Up to K tokens that may follow `req.seq_ids()`; [] when there is no good guess
        (the request then decodes one token, as without speculation)."""

    def propose_all(self, reqs: list[Req], max_tokens: list[int] | None = None) -> list[Draft]:
        """One draft per request (a model drafter batches them); deterministic by default.
        `max_tokens`: the most tokens the caller keeps of each draft (it cuts them), so a
        drafter that pays per drafted token may stop there; None: K."""
        return [Draft(self.propose(req)) for req in reqs]

    def on_forward(  # noqa: B027 (optional hook, no-op by default)
        self,
        reqs: list[Req],
        starts: list[int],
        lengths: list[int],
        logits: LogitsOutput,
        trees: list[Draft | None] | None = None,
    ) -> None:
        """Sees a target forward before its commit: request i put `lengths[i]` tokens at
        positions from `starts[i]` (EAGLE-3 keeps their hidden states), the last of them a
        draft tree's nodes where `trees[i]` is one; nothing by default."""

    def on_verified(self, req: Req, num_draft: int, num_accepted: int) -> int:
        """Learns from one decode step of `req` (its new tokens are in `req.output_ids`):
        `num_draft` tokens of this drafter's draft verified, `num_accepted` kept. Returns what
        the adaptive policy judges the step by: by default `num_accepted` (AUTO: the most
        any of its candidates would have had accepted)."""
        return num_accepted

    def on_finished(self, req: Req) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Learns from a request that finished (its prompt + output); nothing by default."""

    def release(self, req: Req) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Frees what the drafter holds for a request that left the batch (finished,
        aborted or retracted); nothing by default."""


def draft_steps(drafter: Drafter, max_tokens: list[int] | None) -> int:
    """The draft steps a batch of proposals needs: K, or fewer where every request keeps
    fewer tokens (a probe after a back-off keeps one, a request near max_new_tokens few)."""
    if not max_tokens:
        return drafter.num_draft_tokens
    return max(1, min(drafter.num_draft_tokens, max(max_tokens)))


class SequenceArrays:
    """Each request's `seq_ids()` as an int64 array, kept between steps so that only the
    output tokens added since the last call are converted (lookup drafters read it)."""

    def __init__(self):
        self._arrays: weakref.WeakKeyDictionary[Req, np.ndarray] = weakref.WeakKeyDictionary()

    def get(self, req: Req) -> np.ndarray:
        seq = self._arrays.get(req)
        if seq is None:
            seq = np.asarray(req.input_ids, dtype=np.int64)
        num_output = len(seq) - len(req.input_ids)
        if num_output < len(req.output_ids):
            added = np.asarray(req.output_ids[num_output:], dtype=np.int64)
            seq = np.concatenate([seq, added])
        self._arrays[req] = seq
        return seq

    def forget(self, req: Req) -> None:
        self._arrays.pop(req, None)
