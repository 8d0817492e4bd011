"""Self-distilled training data for an EAGLE-3 head, captured while the target answers: a
batched greedy (or sampled) generation loop over the target's ModelRunner whose every
forward also returns what the head reads (the hidden states entering the three aux layers)
and the final hidden states (what the target's logits come from), so no second forward
over the finished sequences is needed.

    prompts --prefill + decode steps, aux layers + FINAL_HIDDEN captured-->
        ids (prompt + answer), aux [T, 3 * hidden] bf16, final [T - prompt_len, hidden] bf16
    counts of response tokens --> draft vocabulary (most frequent, as SpecForge's)
    final @ the target's LM head rows of the draft vocabulary --> the target's logits over
        the draft vocabulary at the positions that predict answer tokens (per chunk, when
        the trainer reads it: train/eagle3_trainer.py)
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.model.eagle3 import default_aux_layers
from radixserve.model.llama import FINAL_HIDDEN
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import chat_prompt_text

logger = logging.getLogger(__name__)


@dataclass
class Captured:
    """One answered prompt as the trainer reads it. `aux[i]`: what enters the aux layers at
    token i (the last token's row is zeros: it never enters the target, and no row that
    reads it has a target); `final[j]`: the target's final hidden state at position
    `prompt_len - 1 + j`, whose logits predict answer token j."""

    ids: torch.Tensor  # [T] int64
    prompt_len: int
    aux: torch.Tensor  # [T, 3 * hidden] bf16
    final: torch.Tensor  # [T - prompt_len, hidden] bf16


@dataclass
class _Answer:
    """A request of the generation loop: its tokens so far, pages and captured rows."""

    ids: list[int]
    prompt_len: int
    pages: list[int]
    aux: list[torch.Tensor]
    final: list[torch.Tensor]

    def captured(self) -> Captured:
        aux = torch.cat(self.aux)
        pad = aux.new_zeros(len(self.ids) - aux.shape[0], aux.shape[1])
        return Captured(torch.tensor(self.ids, dtype=torch.int64), self.prompt_len,
                        torch.cat([aux, pad]), torch.cat(self.final))  # fmt: skip


def digest(data: list[Captured]) -> str:
    """sha256 of the token ids and prompt lengths: the data a head was trained on."""
    blob = [[s.ids.tolist() for s in data], [s.prompt_len for s in data]]
    return hashlib.sha256(json.dumps(blob, separators=(",", ":")).encode()).hexdigest()


def num_response_tokens(data: list[Captured]) -> int:
    return sum(len(s.ids) - s.prompt_len for s in data)


def prompt_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The prompts as the target's chat template renders them (plain text without one)."""
    chat = getattr(tokenizer, "chat_template", None) is not None
    texts = [chat_prompt_text(tokenizer, p) if chat else p for p in prompts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@torch.inference_mode()
def answer_and_capture(
    runner: ModelRunner,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_ids: tuple[int, ...],
    batch_size: int,
) -> list[Captured]:
    """The target's own answers to `prompt_ids`, `batch_size` at a time, each with the rows
    it captured (empty answers dropped); greedy where `temperature` is 0."""
    generator = torch.Generator().manual_seed(seed)
    runner.aux_layers = default_aux_layers(runner.config.num_layers) + (FINAL_HIDDEN,)
    out: list[Captured] = []
    try:
        for start in range(0, len(prompt_ids), batch_size):
            group = prompt_ids[start : start + batch_size]
            out += _answer_group(runner, group, max_new_tokens, temperature, generator, eos_ids)
            logger.info("answered %d of %d prompts", start + len(group), len(prompt_ids))
    finally:
        runner.aux_layers = ()
    return out


def _answer_group(runner, prompts, max_new_tokens, temperature, generator, eos_ids):
    pool, hidden = runner.pool, runner.config.hidden_size
    reqs = [
        _Answer(list(p), len(p), pool.extend_page_table([], len(p) + max_new_tokens), [], [])
        for p in prompts
    ]
    try:
        live, new = reqs, [list(p) for p in prompts]
        while live:
            prefix_lens = [len(r.ids) - len(n) for r, n in zip(live, new)]
            pages = [r.pages for r in live]
            batch = ForwardBatch.build(new, prefix_lens, pages, pool.page_size, runner.device)
            logits = runner.forward(batch)
            aux = logits.aux_hidden.to(torch.bfloat16).cpu()  # [num_tokens, 4 * hidden]
            tokens = _pick(logits.last, temperature, generator).tolist()
            rows = aux.split(batch.extend_lens)
            for req, row, token in zip(live, rows, tokens):
                req.aux.append(row[:, : 3 * hidden])
                req.final.append(row[-1:, 3 * hidden :])
                req.ids.append(token)
            live = [
                r for r in live
                if r.ids[-1] not in eos_ids and len(r.ids) - r.prompt_len < max_new_tokens
            ]  # fmt: skip
            new = [[r.ids[-1]] for r in live]
    finally:
        for req in reqs:
            pool.allocator.free(req.pages)
    return [r.captured() for r in reqs]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).flatten()


def draft_vocabulary(data: list[Captured], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties: the lower id; too few distinct tokens:
    filled with the lowest unused ids), sorted: draft id i is target id hot[i]."""
    counts = Counter(t for s in data for t in s.ids[s.prompt_len :].tolist())
    size = min(size, vocab_size)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    fill = (t for t in range(vocab_size) if t not in counts)
    chosen += [next(fill) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def target_head_weight(model) -> torch.Tensor:
    """The target's LM head as a [vocab, hidden] matrix (tied: its embedding table)."""
    if model.lm_head is None:
        return model.embed_tokens.weight.detach()
    return model.lm_head.dequantize().detach()
