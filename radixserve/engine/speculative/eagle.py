"""EAGLE drafting: a one-layer head (EAGLE3: model/eagle3.py, EAGLE-1/2: model/eagle1.py,
one interface: model/eagle_head.py) reads the target's hidden states and proposes a chain of
num_steps tokens (topk 1) or a tree (eagle_tree.py) through the Drafter seam.

    target forward (any: prefill chunk, decode, verify)   aux hidden of its positions
        -> on_forward: pending rows at their positions (a gap restarts)
    propose (sequence x_0 .. x_{n-1}):
        step 1   pending p .. n-2: (head.fuse(aux_p), embed(x_{p+1})) over the kept K/V -> d1
                 (their K/V is kept: both inputs are committed, so it never changes)
        step j   (pre-norm hidden of step j-1, embed(d_{j-1})) at position n-3+j -> dj
                 (K/V of the draft steps is scratch)

    per request   | K/V of positions first .. (<= EAGLE_WINDOW) | pending aux rows |

Pending rows past n-2 (a verify's rejected drafts) are cut before use. Rows are fused when a
proposal reads them, all requests' in one fc call: a request the adaptive policy keeps from
drafting costs a row copy per step, not an fc over its row (on the default model ~0.3 ms of
a 10 ms step), and a probe after a back-off fuses its window at once. Design: the head's
K/V lives in small per-request tensors, not a paged pool: one layer of K/V is 1/L of the
target's per token and is capped at a window, so there is nothing to page, evict or keep
consistent with the radix tree; a prefix hit or a retracted request simply starts with none
(the head then sees fewer positions). Drafts are lossless either way: the target verifies.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from radixserve.config import LoadConfig, SchedulerConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Draft, Drafter, draft_steps
from radixserve.engine.speculative.eagle_tree import draft_trees
from radixserve.engine.speculative.model_drafter import SamplingRows
from radixserve.engine.speculative.row_buffer import RowBuffer
from radixserve.engine.speculative.tree_verify import children_of
from radixserve.model.eagle1 import load_eagle1_head
from radixserve.model.eagle3 import load_eagle3_head
from radixserve.model.eagle_head import linear_weight, pack_for_cpu
from radixserve.model.runner import LogitsOutput, ModelRunner
from radixserve.model.source import default_eagle3_head, is_default_model

# 64: EAGLE's heads are trained on full contexts, but what predicts the next few tokens sits
# in the last few dozen; the K/V kept per request and the attention grow linearly with it.
EAGLE_WINDOW = 64


@dataclass
class EagleState:
    """A request's head K/V of positions first .. first + C - 1 ([kv_heads, C, head_dim]
    each), then the captured aux hidden states of the positions after them, not yet fused
    ([num_rows, k * target hidden])."""

    first: int
    keys: torch.Tensor | None
    values: torch.Tensor | None
    rows: RowBuffer
    tree: VerifiedTree | None = None  # the rows of a tree the last forward verified

    @property
    def kv_end(self) -> int:
        """The first position without K/V."""
        return self.first + (0 if self.keys is None else self.keys.shape[1])


@dataclass
class VerifiedTree:
    """A draft tree's aux rows [N, k * target hidden] (node j at row j - 1), its root's
    position."""

    root: int
    draft: Draft
    rows: torch.Tensor

    def path_rows(self, seq: list[int]) -> torch.Tensor:
        """The rows of the nodes the committed sequence `seq` follows from the root."""
        kids = children_of(self.draft.parents)
        node, picked = 0, []
        for token in seq[self.root + 1 :]:
            child = next((c for c in kids[node] if self.draft.tokens[c - 1] == token), None)
            if child is None:
                break
            picked.append(child - 1)
            node = child
        return self.rows[picked]


@dataclass
class Pending:
    """What step 1 of a request computes: rows of positions start .. n-2, the tokens after."""

    state: EagleState
    start: int
    rows: torch.Tensor  # [length, hidden]: fused (aux rows until propose_all fuses them)
    tokens: list[int]  # x_{start+1} .. x_{n-1}


class EagleDrafter(Drafter):
    def __init__(
        self,
        head,
        num_steps: int,
        window: int = EAGLE_WINDOW,
        topk: int = 1,
        num_nodes: int | None = None,
        algorithm: str = "EAGLE3",
    ):
        """`head`: an Eagle3Head or Eagle1Head (`algorithm` EAGLE3 or EAGLE); `topk` > 1:
        draft trees of `num_nodes` nodes (eagle_tree.py); 1: chains."""
        self.head, self.algorithm = head, algorithm
        self.num_draft_tokens = num_steps  # a tree's depth: the most tokens a path adds
        self.window = window
        self.topk, self.num_nodes = topk, num_nodes or num_steps
        # pending rows kept: a window plus a verify's tail
        self._kept = window + max(num_steps, self.num_nodes) + 1
        self._states: weakref.WeakKeyDictionary[Req, EagleState] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def on_forward(
        self,
        reqs: list[Req],
        starts: list[int],
        lengths: list[int],
        logits: LogitsOutput,
        trees: list[Draft | None] | None = None,
    ) -> None:
        """Keeps the aux hidden states of each speculating request's last positions in the
        forward (only the rows a window can still read), and a verified tree's rows until the
        commit tells which path was kept."""
        aux = logits.aux_hidden
        if aux is None:
            return
        trees = trees or [None] * len(reqs)
        rows: list[int] = []
        spans: list[tuple[Req, int, int, Draft | None]] = []
        offset = 0
        for req, start, length, tree in zip(reqs, starts, lengths, trees):
            num_tree = 0 if tree is None else len(tree.tokens)
            seq_len = length - num_tree  # the sequence's tokens, the root last
            keep = min(seq_len, self._kept) if req.params.speculative else 0
            if keep:
                rows.extend(range(offset + seq_len - keep, offset + length))
                spans.append((req, start + seq_len - keep, keep, tree))
            offset += length
        if not rows:
            return
        kept = aux[torch.tensor(rows, device=aux.device)]  # [rows, k * hidden], a copy
        offset = 0
        for req, start, keep, tree in spans:
            self._append(req, start, kept[offset : offset + keep])
            offset += keep
            if tree is not None:
                tree_rows = kept[offset : offset + len(tree.tokens)]
                self._states[req].tree = VerifiedTree(start + keep - 1, tree, tree_rows)
                offset += len(tree.tokens)

    def propose(self, req: Req) -> list[int]:
        return self.propose_all([req])[0].tokens

    @torch.inference_mode()
    def propose_all(self, reqs: list[Req], max_tokens: list[int] | None = None) -> list[Draft]:
        """A chain (or tree) for each request whose hidden states reach its last committed
        token, of num_steps steps or the fewer every request keeps (`max_tokens`)."""
        pending = {r: p for r in reqs if (p := self._pending(r)) is not None}
        drafts = {r: Draft([]) for r in reqs}
        ready = list(pending)
        if ready:
            fused = self._fused([pending[r] for r in ready])
            for req, draft in zip(ready, self._draft(ready, fused, draft_steps(self, max_tokens))):
                drafts[req] = draft
        return [drafts[r] for r in reqs]

    def _fused(self, pending: list[Pending]) -> list[Pending]:
        """The pending aux rows of every request through the head's fc in one call."""
        fused = self.head.fuse(torch.cat([p.rows for p in pending]))
        out, offset = [], 0
        for p in pending:
            out.append(dataclasses.replace(p, rows=fused[offset : offset + len(p.rows)]))
            offset += len(p.rows)
        return out

    def release(self, req: Req) -> None:
        self._states.pop(req, None)

    def _append(self, req: Req, start: int, rows: torch.Tensor) -> None:
        state = self._states.get(req)
        if state is not None:
            _resolve_tree(req, state)
        if state is None or not state.kv_end <= start <= state.kv_end + len(state.rows):
            state = EagleState(start, None, None, RowBuffer(rows))  # new, or a gap (prefix hit)
        else:
            state.rows.put(start - state.kv_end, rows)
        if len(state.rows) > self._kept:  # the K/V would be out of the window anyway
            state.rows.drop_front(len(state.rows) - self._kept)
            state = EagleState(start + len(rows) - self._kept, None, None, state.rows)
        self._states[req] = state

    def _pending(self, req: Req) -> Pending | None:
        state = self._states.get(req)
        if state is not None:
            _resolve_tree(req, state)
        end = req.seq_len - 1  # positions < end are committed; end - 1 is the query
        if state is None or not state.kv_end < end <= state.kv_end + len(state.rows):
            return None
        if end + self.num_draft_tokens > self.head.rotary.max_positions:
            return None
        start = state.kv_end
        rows = state.rows.rows[: end - start]
        return Pending(state, start, rows, req.seq_ids()[start + 1 : end + 1])

    def _draft(self, reqs: list[Req], pending: list[Pending], num_steps: int) -> list[Draft]:
        inputs = _StepOne.build(pending, linear_weight(self.head.fc), self.head.config.hidden_size)
        sampling = SamplingRows(reqs, self.head.vocab_size, inputs.hidden.device)
        step = self.head(inputs.hidden, inputs.tokens, inputs.positions, inputs.cache, inputs.mask)
        self._keep_kv(pending, step, inputs.num_new)
        if self.topk > 1:
            last = inputs.positions[:, -1:]
            return draft_trees(self.head, step, inputs.key_valid, last, self.topk,
                               num_steps, self.num_nodes)  # fmt: skip
        valid, picks = inputs.key_valid, []
        for j in range(num_steps):
            chosen, probs = sampling.pick(step.logits, j)
            picks.append((chosen, probs))
            if j + 1 == num_steps:
                break
            valid = torch.cat([valid, valid.new_ones(len(reqs), 1)], dim=1)
            step = self.head(
                step.hidden[:, -1:],
                chosen[:, None],
                inputs.positions[:, -1:] + j + 1,
                (step.keys, step.values),
                valid[:, None, None, :],
            )
        return sampling.drafts(picks)

    def _keep_kv(self, pending: list[Pending], step, num_new: list[int]) -> None:
        """Step 1's columns of committed positions join each request's kept K/V."""
        for b, (p, new) in enumerate(zip(pending, num_new)):
            state = p.state
            keys, values = step.keys[b, :, -new:], step.values[b, :, -new:]
            if state.keys is not None:
                keys, values = (
                    torch.cat([state.keys, keys], 1),
                    torch.cat([state.values, values], 1),
                )
            excess = max(0, keys.shape[1] - self.window)
            state.first += excess
            state.keys, state.values = keys[:, excess:].clone(), values[:, excess:].clone()
            state.rows.clear()  # used; any tail was a rejected draft's


@dataclass
class _StepOne:
    """Step 1's batch: each request's pending columns right-aligned (so that draft steps
    append one column to all) after its kept K/V, left-padded: hidden [B, N, hidden],
    tokens / positions [B, N], cache (keys, values) [B, kv_heads, C, head_dim] or None,
    mask [B, 1, N, C + N], key_valid [B, C + N] (False: padding)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor
    key_valid: torch.Tensor
    num_new: list[int]

    @classmethod
    def build(cls, pending: list[Pending], like: torch.Tensor, hidden_size: int) -> _StepOne:
        """`like`: a tensor of the head's dtype and device."""
        device, batch = like.device, len(pending)
        num_new = [len(p.tokens) for p in pending]
        width = max(num_new)
        hidden = torch.zeros(batch, width, hidden_size, dtype=like.dtype, device=device)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        new_valid = torch.zeros(batch, width, dtype=torch.bool)
        for b, p in enumerate(pending):
            pad = width - num_new[b]
            hidden[b, pad:] = p.rows
            tokens[b, pad:] = torch.tensor(p.tokens)
            positions[b, pad:] = torch.arange(p.start, p.start + num_new[b])
            new_valid[b, pad:] = True
        cache, cache_valid = _padded_cache([p.state for p in pending], like)
        new_valid = new_valid.to(device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=device)
        new_mask = (new_valid[:, None, :] & causal) | eye  # padded rows see themselves: no NaN
        old_mask = cache_valid[:, None, :].expand(batch, width, cache_valid.shape[1])
        mask = torch.cat([old_mask, new_mask], dim=2)[:, None]
        key_valid = torch.cat([cache_valid, new_valid], dim=1)
        return cls(hidden, tokens.to(device), positions.to(device), cache, mask, key_valid, num_new)


def _resolve_tree(req: Req, state: EagleState) -> None:
    """A verified tree's kept path joins the pending rows (the commit has run since)."""
    tree, state.tree = state.tree, None
    if tree is not None and state.kv_end + len(state.rows) == tree.root + 1:
        state.rows.put(len(state.rows), tree.path_rows(req.seq_ids()))


def _padded_cache(states: list[EagleState], like: torch.Tensor):
    """The kept K/V of each request, left-padded to the longest: ((keys, values) or None,
    valid [B, C])."""
    lengths = [0 if s.keys is None else s.keys.shape[1] for s in states]
    width, device = max(lengths), like.device
    valid = torch.zeros(len(states), width, dtype=torch.bool, device=device)
    if width == 0:
        return None, valid
    shape = next(s.keys for s in states if s.keys is not None).shape
    keys = torch.zeros(len(states), shape[0], width, shape[2], dtype=like.dtype, device=device)
    values = torch.zeros_like(keys)
    for b, (state, length) in enumerate(zip(states, lengths)):
        if length:
            keys[b, :, width - length :] = state.keys
            values[b, :, width - length :] = state.values
            valid[b, width - length :] = True
    return (keys, values), valid


def with_default_head(load: LoadConfig, scheduler: SchedulerConfig) -> SchedulerConfig:
    """EAGLE3 without --speculative-draft-model-path on the default model: the head shipped
    for it; any other target still needs the flag (SchedulerConfig.verify names it)."""
    algorithm = (scheduler.speculative_algorithm or "").upper()  # verify() upper-cases it
    if algorithm != "EAGLE3" or scheduler.speculative_draft_model_path:
        return scheduler
    if not is_default_model(load.model):
        return scheduler
    return dataclasses.replace(scheduler, speculative_draft_model_path=str(default_eagle3_head()))


HEAD_LOADERS = {"EAGLE3": load_eagle3_head, "EAGLE": load_eagle1_head}


def create_eagle_drafter(
    config: SchedulerConfig, target: ModelRunner, algorithm: str = "EAGLE3"
) -> EagleDrafter:
    """Loads the `algorithm` head (EAGLE3 or EAGLE) at --speculative-draft-model-path for
    `target` and makes the target's forwards capture the hidden states the head reads (only
    now: no cost otherwise)."""
    model = target.model
    check_tree_backend(config.speculative_eagle_topk or 1, getattr(target, "attn", None))
    dtype = model.norm.weight.dtype  # the model's (a GGUF embedding may be blocks)
    path = config.speculative_draft_model_path
    head = HEAD_LOADERS[algorithm](path, model, target.device, dtype)
    pack_for_cpu(head)
    target.aux_layers = head.aux_layers
    # capturing forwards run eagerly: decode graphs / compiled steps would only hold memory
    target.decode_graphs = target.compiled_decode = None
    steps, topk = config.speculative_draft_steps, config.speculative_eagle_topk or 1
    if topk == 1:
        return EagleDrafter(head, steps, algorithm=algorithm)
    nodes = config.speculative_num_draft_tokens - 1  # SGLang's count has the root
    return EagleDrafter(head, steps, topk=topk, num_nodes=nodes, algorithm=algorithm)


def check_tree_backend(topk: int, attn) -> None:
    """Tree drafting needs an attention backend that masks a draft tree (torch_native,
    cpu_fused, triton, flashinfer, and hybrid models' per-layer windows over those)."""
    if topk > 1 and not getattr(attn, "supports_tree_mask", False):
        raise ValueError(
            f"--speculative-eagle-topk {topk} verifies a draft tree, which the "
            f"{type(attn).__name__} attention backend does not mask yet; use "
            "--attention-backend torch_native, cpu_fused, triton or flashinfer, or "
            "--speculative-eagle-topk 1"
        )
