"""Draft-model drafting (SELF, STANDALONE): a small model proposes K tokens by K forwards,
batched over the speculating requests, over its own KV pool.

    draft pool (own pages per request, no prefix sharing)
    | committed tokens' K/V (num_computed) | d1 .. d(K-1) K/V (scratch) |
    propose: forward 1 = the committed tokens not yet computed (>= the last one) -> d1
             forward j = d(j-1)                                               -> dj
    then num_computed = the committed length: the drafts' K/V is rewritten next time.

SELF runs the target's own first layers (shared weights, `LayerSkipModel`); STANDALONE a
second model with the target's tokenizer (`load_draft_runner` checks it at start). Greedy
requests draft the argmax; sampled ones draw from q = the draft's distribution after their
temperature and filters, returned with the draft for the verifier's rejection rule.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.attention import create_model_attention
from radixserve.cache.kv_pool import KVPool
from radixserve.config import CacheConfig, LoadConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Draft, Drafter, draft_steps
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer
from radixserve.sampling.sampler import SamplingBatch, scale_and_filter

_SEED_SALT = 0x5EED_D4AF  # separates the draft's draws from the verifier's noise


@dataclass
class DraftState:
    """A request's pages in the draft pool and how many of its tokens' K/V they hold."""

    page_table: list[int]
    num_computed: int = 0


class LayerSkipModel(nn.Module):
    """The target's first `num_layers` layers, final norm and LM head (weights shared)."""

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        self.target = target
        self.layers = target.layers[:num_layers]

    def forward(self, batch: ForwardBatch, attn) -> torch.Tensor:
        return self.target.forward_layers(batch, attn, self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def self_draft_runner(target: ModelRunner, num_layers: int, attention_backend: str) -> ModelRunner:
    """SELF's draft: the target's first layers over a pool of that many layers, as many
    tokens as the target's pool."""
    if num_layers >= target.config.num_layers:
        raise ValueError(
            f"speculative_self_layers must be below the target's {target.config.num_layers} "
            f"layers; got {num_layers}"
        )
    config = dataclasses.replace(target.config, num_layers=num_layers)
    pool = _draft_pool(config, target)
    attn = create_model_attention(
        attention_backend,
        pool,
        target.device,
        config.layer_windows(),
        config.num_heads,
        logit_cap=config.attn_logit_cap,
    )
    model = LayerSkipModel(target.model, num_layers)
    return ModelRunner(model=model, config=config, pool=pool, attn=attn)


def load_draft_runner(
    path: str,
    load_config: LoadConfig,
    cache_config: CacheConfig,
    target: ModelRunner,
    target_tokenizer,
) -> ModelRunner:
    """STANDALONE's draft model from `path`, on the target's device and dtype, with a pool
    of as many tokens as the target's; refused unless it shares the target's vocabulary."""
    loaded = load_model(dataclasses.replace(load_config, model=path, quantization="auto"))
    check_same_vocab(loaded, target, target_tokenizer)
    draft_cache = dataclasses.replace(
        cache_config,
        max_total_tokens=target.pool.capacity_tokens,
        disable_cuda_graph=True,
        enable_torch_compile=False,  # not measured for drafts yet
        disable_hybrid_swa_memory=True,  # own pages per request, never past their windows
    )
    return ModelRunner.from_loaded(loaded, load_config, draft_cache)


def check_same_vocab(draft: LoadedModel, target: ModelRunner, target_tokenizer) -> None:
    """A draft must speak the target's token ids: same vocabulary size and token -> id map."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            "speculative_draft_model_path: the draft model's vocabulary has "
            f"{draft.config.vocab_size} tokens, the target's {target.config.vocab_size}"
        )
    if target_tokenizer is None:
        return
    if load_tokenizer(draft).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            "speculative_draft_model_path: the draft model's tokenizer differs from the "
            "target's (the same token ids would mean other text)"
        )


def _draft_pool(config, target: ModelRunner) -> KVPool:
    cache = CacheConfig(
        page_size=target.pool.page_size, max_total_tokens=target.pool.capacity_tokens
    )
    return KVPool.for_model(config, cache, target.pool.dtype, target.device)


class ModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, num_draft_tokens: int, algorithm: str = "STANDALONE"):
        self.algorithm = algorithm  # SELF or STANDALONE
        self.runner = runner
        self.pool = runner.pool
        self.num_draft_tokens = num_draft_tokens
        self._states: weakref.WeakKeyDictionary[Req, DraftState] = weakref.WeakKeyDictionary()

    def propose(self, req: Req) -> list[int]:
        return self.propose_all([req])[0].tokens

    def propose_all(self, reqs: list[Req], max_tokens: list[int] | None = None) -> list[Draft]:
        """K forwards (fewer where every request keeps fewer tokens: `max_tokens`) over the
        requests that got draft pages; the others get no draft."""
        ready = [r for r in reqs if self._reserve(r)]
        drafts = {r: Draft([]) for r in reqs}
        if ready:
            for req, draft in zip(ready, self._draft(ready, draft_steps(self, max_tokens))):
                drafts[req] = draft
        return [drafts[r] for r in reqs]

    def release(self, req: Req) -> None:
        state = self._states.pop(req, None)
        if state is not None and state.page_table:
            self.pool.allocator.free(state.page_table)

    def _reserve(self, req: Req) -> bool:
        """Pages for the request's sequence plus K - 1 draft tokens; False if none are free
        or the draft model's positions end before that."""
        num_tokens = req.seq_len + self.num_draft_tokens - 1
        if num_tokens > self.runner.config.max_position_embeddings:
            return False
        state = self._states.setdefault(req, DraftState([]))
        needed = self.pool.num_pages_for(num_tokens)
        missing = needed - len(state.page_table)
        if missing > self.pool.allocator.num_free:
            return False
        if missing > 0:
            state.page_table += self.pool.allocator.allocate(missing).tolist()
        return True

    def _draft(self, reqs: list[Req], num_steps: int) -> list[Draft]:
        states = [self._states[r] for r in reqs]
        seqs = [r.seq_ids() for r in reqs]
        # at least the last token: its logits give d1 (nothing new since a failed step: redo)
        prefix = [min(s.num_computed, len(seq) - 1) for seq, s in zip(seqs, states)]
        tokens = [seq[start:] for seq, start in zip(seqs, prefix)]
        steps: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        sampling = SamplingRows(reqs, self.runner.config.vocab_size, self.runner.device)
        for j in range(num_steps):
            logits = self._forward(tokens, prefix, states)
            chosen, probs = sampling.pick(logits, j)
            steps.append((chosen, probs))
            prefix = [p + len(t) for p, t in zip(prefix, tokens)]
            tokens = [[t] for t in chosen.tolist()]
        for state, seq in zip(states, seqs):
            state.num_computed = len(seq)  # the drafts' K/V is scratch
        return sampling.drafts(steps)

    def _forward(self, tokens, prefix, states) -> torch.Tensor:
        batch = ForwardBatch.build(
            tokens,
            prefix,
            [s.page_table for s in states],
            self.pool.page_size,
            self.runner.device,
        )
        return self.runner.forward(batch).last  # [num_reqs, vocab]


class SamplingRows:
    """How each request picks its draft tokens: argmax (greedy requests) or a seeded draw
    from q (sampled ones: the draft's logits after their temperature and filters)."""

    def __init__(self, reqs: list[Req], vocab_size: int, device: torch.device):
        self.reqs = reqs
        self.sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        self.batch = None
        if self.sampled:
            chosen = [reqs[i] for i in self.sampled]
            self.batch = SamplingBatch.build(
                [r.params for r in chosen],
                [r.seed for r in chosen],
                [[] for _ in chosen],  # q ignores penalties: any q keeps the rule exact
                [[] for _ in chosen],
                [[] for _ in chosen],
                vocab_size,
                device,
            )

    def pick(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens of draft step `step` [num_reqs] and q of the sampled rows."""
        chosen = logits.argmax(dim=-1)
        if self.batch is None:
            return chosen, None
        rows = torch.tensor(self.sampled, device=logits.device)
        q = scale_and_filter(logits[rows].float(), self.batch, slice(None)).softmax(dim=-1)
        draws = [
            torch.multinomial(q[k], 1, generator=self._generator(i, step, q.device))
            for k, i in enumerate(self.sampled)
        ]
        return chosen.index_copy(0, rows, torch.cat(draws)), q

    def _generator(self, index: int, step: int, device: torch.device) -> torch.Generator:
        req = self.reqs[index]
        seed = hash((req.seed, len(req.output_ids), step, _SEED_SALT)) & 0x7FFFFFFFFFFFFFFF
        return torch.Generator(device=device).manual_seed(seed)

    def drafts(self, steps: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[Draft]:
        tokens = torch.stack([chosen for chosen, _ in steps], dim=1).tolist()  # [num_reqs, K]
        out = [Draft(t) for t in tokens]
        for k, i in enumerate(self.sampled):
            out[i].probs = torch.stack([probs[k] for _, probs in steps])  # [K, vocab]
        return out
