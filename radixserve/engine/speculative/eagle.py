"""EAGLE-3 drafting: a one-layer head (model/eagle3.py) reads the target's hidden states and
proposes a chain of num_steps tokens (topk 1) through the Drafter seam.

    target forward (any: prefill chunk, decode, verify)   aux hidden of its positions
        -> on_forward: fc -> fused rows, appended at their positions (a gap restarts)
    propose (sequence x_0 .. x_{n-1}):
        step 1   columns p = n-1-W .. n-2: (fused_p, embed(x_{p+1})) -> d1 at the last
        step j   (pre-norm hidden of step j-1, embed(d_{j-1})) at position n-3+j -> dj

Rows past n-2 (a verify's rejected drafts) are cut before use, so only committed positions
are read. Design: the head attends over a window of its last EAGLE3_WINDOW positions,
recomputed each step with SDPA instead of a paged KV pool of its own: one layer over <= 64
tokens costs about what 2 target layers of one token do, and there is nothing to page,
evict, retract or keep consistent with the radix tree (a prefix hit or a retracted request
simply starts a shorter window). Drafts are lossless either way: the target verifies them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from radixserve.config import SchedulerConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Draft, Drafter
from radixserve.engine.speculative.model_drafter import SamplingRows
from radixserve.model.eagle3 import Eagle3Head, aux_layers_from_config, load_eagle3_head
from radixserve.model.runner import LogitsOutput, ModelRunner

# 64: EAGLE's heads are trained on full contexts, but what predicts the next few tokens sits
# in the last few dozen; the cost of the window grows linearly with it.
EAGLE3_WINDOW = 64


@dataclass
class EagleState:
    """A request's fused hidden states of positions first .. first + len(rows) - 1."""

    first: int
    rows: torch.Tensor  # [num_rows, hidden]


@dataclass
class Window:
    """What step 1 of a request reads: rows of positions first .. n-2 and the tokens after."""

    first: int
    rows: torch.Tensor  # [length, hidden]
    tokens: list[int]  # x_{first+1} .. x_{n-1}


class Eagle3Drafter(Drafter):
    def __init__(self, head: Eagle3Head, num_steps: int, window: int = EAGLE3_WINDOW):
        self.head = head
        self.num_draft_tokens = num_steps
        self.window = window
        self._kept = window + num_steps + 1  # rows kept: the window plus a verify's tail
        self._states: weakref.WeakKeyDictionary[Req, EagleState] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def on_forward(
        self, reqs: list[Req], starts: list[int], lengths: list[int], logits: LogitsOutput
    ) -> None:
        """Keeps the fused hidden states of each speculating request's last positions in
        the forward (fc runs only on the rows a window can still read)."""
        aux = logits.aux_hidden
        if aux is None:
            return
        rows: list[int] = []
        spans: list[tuple[Req, int, int]] = []
        offset = 0
        for req, start, length in zip(reqs, starts, lengths):
            keep = min(length, self._kept) if req.params.speculative else 0
            if keep:
                rows.extend(range(offset + length - keep, offset + length))
                spans.append((req, start + length - keep, keep))
            offset += length
        if not rows:
            return
        fused = self.head.fuse(aux[torch.tensor(rows, device=aux.device)])  # [rows, hidden]
        offset = 0
        for req, start, keep in spans:
            self._append(req, start, fused[offset : offset + keep])
            offset += keep

    def propose(self, req: Req) -> list[int]:
        return self.propose_all([req])[0].tokens

    @torch.inference_mode()
    def propose_all(self, reqs: list[Req]) -> list[Draft]:
        """A chain for each request whose hidden states reach its last committed token."""
        windows = {r: w for r in reqs if (w := self._window(r)) is not None}
        drafts = {r: Draft([]) for r in reqs}
        ready = list(windows)
        if ready:
            for req, draft in zip(ready, self._draft(ready, [windows[r] for r in ready])):
                drafts[req] = draft
        return [drafts[r] for r in reqs]

    def release(self, req: Req) -> None:
        self._states.pop(req, None)

    def _append(self, req: Req, start: int, rows: torch.Tensor) -> None:
        state = self._states.get(req)
        if state is None or not state.first <= start <= state.first + len(state.rows):
            state = EagleState(start, rows.clone())  # new, or a gap (prefix hit, retraction)
        else:
            state.rows = torch.cat([state.rows[: start - state.first], rows])
        excess = len(state.rows) - self._kept
        if excess > 0:
            state.first, state.rows = state.first + excess, state.rows[excess:]
        self._states[req] = state

    def _window(self, req: Req) -> Window | None:
        state = self._states.get(req)
        end = req.seq_len - 1  # rows of positions < end are committed; end - 1 is needed
        if state is None or not state.first < end <= state.first + len(state.rows):
            return None
        if end + self.num_draft_tokens > self.head.rotary.max_positions:
            return None
        first = max(state.first, end - self.window)
        rows = state.rows[first - state.first : end - state.first]
        return Window(first, rows, req.seq_ids()[first + 1 : end + 1])

    def _draft(self, reqs: list[Req], windows: list[Window]) -> list[Draft]:
        hidden, tokens, positions, valid = _left_padded(windows, self.head.fc.weight)
        width = hidden.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=hidden.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=hidden.device)
        mask = (valid[:, None, None, :] & causal) | eye  # padded rows see themselves: no NaN
        sampling = SamplingRows(reqs, self.head.vocab_size, hidden.device)
        step = self.head(hidden, tokens, positions, None, mask)
        picks = []
        for j in range(self.num_draft_tokens):
            chosen, probs = sampling.pick(step.logits, j)
            picks.append((chosen, probs))
            if j + 1 == self.num_draft_tokens:
                break
            valid = torch.cat([valid, valid.new_ones(len(reqs), 1)], dim=1)
            step = self.head(
                step.hidden[:, -1:],
                chosen[:, None],
                positions[:, -1:] + j + 1,
                (step.keys, step.values),
                valid[:, None, None, :],
            )
        return sampling.drafts(picks)


def _left_padded(windows: list[Window], like: torch.Tensor):
    """Step 1's inputs, windows right-aligned so that draft steps append one column to all:
    hidden [B, T, hidden], tokens and positions [B, T], valid [B, T] (False: padding)."""
    width = max(len(w.tokens) for w in windows)
    batch, device = len(windows), like.device
    hidden = torch.zeros(batch, width, like.shape[0], dtype=like.dtype, device=device)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for b, w in enumerate(windows):
        pad = width - len(w.tokens)
        hidden[b, pad:] = w.rows
        tokens[b, pad:] = torch.tensor(w.tokens)
        positions[b, pad:] = torch.arange(w.first, w.first + len(w.tokens))
        valid[b, pad:] = True
    return hidden, tokens.to(device), positions.to(device), valid.to(device)


def create_eagle3_drafter(config: SchedulerConfig, target: ModelRunner) -> Eagle3Drafter:
    """Loads the head at --speculative-draft-model-path for `target` and makes the target's
    forwards capture the hidden states the head reads (only now: no cost otherwise)."""
    model = target.model
    dtype = model.embed_tokens.weight.dtype
    head = load_eagle3_head(config.speculative_draft_model_path, model, target.device, dtype)
    target.aux_layers = aux_layers_from_config(head.config.hf_config, target.config.num_layers)
    # capturing forwards run eagerly: decode graphs / compiled steps would only hold memory
    target.decode_graphs = target.compiled_decode = None
    return Eagle3Drafter(head, config.speculative_draft_steps)
