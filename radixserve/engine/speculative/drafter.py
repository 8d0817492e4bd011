"""Drafter: the seam every speculative algorithm plugs into. A drafter proposes tokens that
a request's sequence may continue with; the target model verifies them in the running batch
(verifier.py), so a bad draft costs compute but never changes the output."""

from __future__ import annotations

from abc import ABC, abstractmethod

from radixserve.engine.request import Req


class Drafter(ABC):
    """Proposes draft tokens for a decoding request (NGRAM today; STANDALONE, SELF later)."""

    num_draft_tokens: int  # K: the most tokens `propose` returns

    @abstractmethod
    def propose(self, req: Req) -> list[int]:
        """Up to K tokens that may follow `req.seq_ids()`; [] when there is no good guess
        (the request then decodes one token, as without speculation)."""

    def on_finished(self, req: Req) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Learns from a request that finished (its prompt + output); nothing by default."""
