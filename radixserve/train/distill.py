"""Self-distilled training data for an EAGLE-3 head: the target answers the prompts itself
(radixserve.Engine), then one capturing forward per sequence records what the head reads
(the hidden states entering the three aux layers) and what it learns (the target's logits).

    prompts --Engine.generate--> prompt ids + response ids        (the model's own answers)
    counts of response tokens --> draft vocabulary (most frequent, as SpecForge's)
    ModelRunner forward, aux layers set --> aux [T, 3 * hidden] bf16, final hidden states
        @ the target's LM head rows of the draft vocabulary --> logits [R, V_d] fp16 at the
        positions that predict answer tokens
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from radixserve.client.engine import Engine
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.eagle3 import default_aux_layers
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import chat_prompt_text

logger = logging.getLogger(__name__)

GENERATE_BATCH = 64  # prompts per Engine.generate call (progress is logged after each)


@dataclass
class Sequences:
    """The generated conversations: token ids of each (prompt + response), prompt lengths."""

    ids: list[list[int]]
    prompt_lens: list[int]

    def digest(self) -> str:
        """sha256 of the token ids: the data a head was trained on, for its README."""
        blob = json.dumps([self.ids, self.prompt_lens], separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.ids, self.prompt_lens))


@dataclass
class Captured:
    """One sequence as the trainer reads it. `targets[j]`: the target's logits over the
    draft vocabulary at position `prompt_len - 1 + j` (predicting answer token j);
    `in_vocab[j]`: answer token j is in the draft vocabulary (for greedy answers: the
    target's top token there, SpecForge's mask)."""

    ids: torch.Tensor  # [T] int64
    prompt_len: int
    aux: torch.Tensor  # [T, 3 * hidden] bf16
    targets: torch.Tensor  # [T - prompt_len, V_d] fp16
    in_vocab: torch.Tensor  # [T - prompt_len] bool


def generate(
    engine: Engine, prompts: list[str], max_new_tokens: int, temperature: float, seed: int
) -> Sequences:
    """The target's own answers to `prompts` (chat-formatted where the tokenizer can)."""
    tokenizer = engine.tokenizer
    chat = getattr(tokenizer, "chat_template", None) is not None
    texts = [chat_prompt_text(tokenizer, p) if chat else p for p in prompts]
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = [
        {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampling_seed": seed + i}
        for i in range(len(prompts))
    ]
    outputs = []
    for start in range(0, len(prompts), GENERATE_BATCH):
        part = slice(start, start + GENERATE_BATCH)
        outputs += engine.generate(input_ids=prompt_ids[part], sampling_params=params[part],
                                   progress_bar=False)  # fmt: skip
        logger.info("answered %d of %d prompts", len(outputs), len(prompts))
    ids = [p + o["output_ids"] for p, o in zip(prompt_ids, outputs)]
    keep = [i for i, o in enumerate(outputs) if o["output_ids"]]
    return Sequences([ids[i] for i in keep], [len(prompt_ids[i]) for i in keep])


def draft_vocabulary(seqs: Sequences, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties: the lower id; too few distinct tokens:
    filled with the lowest unused ids), sorted: draft id i is target id hot[i]."""
    counts = Counter(t for s, p in zip(seqs.ids, seqs.prompt_lens) for t in s[p:])
    size = min(size, vocab_size)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    fill = (t for t in range(vocab_size) if t not in counts)
    chosen += [next(fill) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@torch.inference_mode()
def capture(
    runner: ModelRunner, seqs: Sequences, hot: torch.Tensor, max_batch_tokens: int = 2048
) -> list[Captured]:
    """One forward per group of sequences (up to `max_batch_tokens`), capturing the aux
    hidden states at SGLang's default layers and the final hidden states, whose logits are
    computed over the draft vocabulary only, at the positions that predict answer tokens."""
    runner.aux_layers = default_aux_layers(runner.config.num_layers)
    head_rows = target_head_weight(runner.model)[hot.to(runner.device)].float()
    pool, out = runner.pool, []
    order = list(range(len(seqs.ids)))
    while order:
        group, used = [], 0
        while order and (not group or used + len(seqs.ids[order[0]]) <= max_batch_tokens):
            used += len(seqs.ids[order[0]])
            group.append(order.pop(0))
        tables = [pool.extend_page_table([], len(seqs.ids[i])) for i in group]
        try:
            batch = ForwardBatch.build(
                [seqs.ids[i] for i in group], [0] * len(group), tables, pool.page_size,
                runner.device,
            )  # fmt: skip
            hidden, aux = runner.forward_hidden(batch)
        finally:
            for table in tables:
                pool.allocator.free(table)
        start = 0
        for i in group:
            ids, prompt_len = seqs.ids[i], seqs.prompt_lens[i]
            rows = hidden[start + prompt_len - 1 : start + len(ids) - 1].float()
            out.append(
                Captured(
                    ids=torch.tensor(ids, dtype=torch.int64),
                    prompt_len=prompt_len,
                    aux=aux[start : start + len(ids)].to(torch.bfloat16).cpu(),
                    targets=(rows @ head_rows.t()).to(torch.float16).cpu(),
                    in_vocab=torch.isin(torch.tensor(ids[prompt_len:]), hot),
                )
            )
            start += len(ids)
    runner.aux_layers = ()
    return out


def target_head_weight(model) -> torch.Tensor:
    """The target's LM head as a [vocab, hidden] matrix (tied: its embedding table)."""
    if model.lm_head is None:
        return model.embed_tokens.weight.detach()
    return model.lm_head.dequantize().detach()


def capture_runner(engine: Engine, load_config: LoadConfig, max_tokens: int) -> ModelRunner:
    """A runner over the engine's loaded model (no second load) with a pool of its own for
    the capturing forwards; call it once the engine has finished generating."""
    return ModelRunner.from_loaded(
        engine.core.loaded, load_config, CacheConfig(max_total_tokens=max_tokens)
    )
