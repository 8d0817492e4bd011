"""`radixserve train-eagle`: an EAGLE-3 head for a target model, trained on the target's own
answers (train/distill.py) with the training-time test (train/ttt.py), written in SGLang's
llama_eagle3 layout (what model/eagle3.py loads): config.json + model.safetensors (bf16)
+ training.json (the command's settings, the data's sha256, losses, CPU time)."""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve.config import ModelConfig, TrainEagleConfig, split_engine_kwargs
from radixserve.engine.speculative.eagle import EAGLE_WINDOW
from radixserve.model.eagle3 import Eagle3Head, default_aux_layers
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer
from radixserve.train.distill import (
    Captured,
    answer_and_capture,
    digest,
    draft_vocabulary,
    num_response_tokens,
    prompt_token_ids,
    target_head_weight,
)
from radixserve.train.prompts import SOURCE, build_prompts
from radixserve.train.ttt import Chunk, ttt_loss

logger = logging.getLogger(__name__)


def train_eagle3(config: TrainEagleConfig, engine_args: dict) -> dict:
    """Answers and captures in one pass, trains and saves; returns the run's record
    (training.json)."""
    torch.manual_seed(config.seed)
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    load_config, cache_config = split_engine_kwargs(None, engine_args)[:2]
    loaded = load_model(load_config)
    tokenizer = load_tokenizer(loaded)
    prompts = build_prompts(config.num_prompts, config.seed)
    prompt_ids = prompt_token_ids(tokenizer, prompts)
    batch = min(config.generate_batch, len(prompt_ids))
    longest = max(map(len, prompt_ids)) + config.max_new_tokens + cache_config.page_size
    pool = replace(cache_config, max_total_tokens=batch * longest)  # one batch's answers
    runner = ModelRunner.from_loaded(loaded, load_config, pool)
    eos = eos_token_ids(loaded, tokenizer)
    data = answer_and_capture(
        runner, prompt_ids, config.max_new_tokens, config.temperature, config.seed, eos, batch
    )
    cpu_gen = _cpu_seconds() - cpu0
    logger.info("answered and captured %d prompts, %d answer tokens (%.0f CPU s)", len(data),
                num_response_tokens(data), cpu_gen)  # fmt: skip
    hot = draft_vocabulary(data, config.draft_vocab_size, loaded.config.vocab_size)
    head = new_head(runner, hot, config.intermediate_size)
    head_rows = target_head_weight(runner.model)[hot].float()
    losses = _train(head, data, head_rows, config)
    folder = save_head(head, hot, runner, Path(config.output))
    record = {
        "config": asdict(config),
        "model": engine_args.get("model") or "default (SmolLM2-135M-Instruct)",
        "prompts": {"source": SOURCE, "count": len(prompts)},
        "data_sha256": digest(data),
        "num_sequences": len(data),
        "response_tokens": num_response_tokens(data),
        "epoch_losses": losses,
        "cpu_seconds": {
            "generate_and_capture": round(cpu_gen),
            "total": round(_cpu_seconds() - cpu0),
        },
        "wall_seconds": round(time.perf_counter() - wall0),
        "torch_threads": torch.get_num_threads(),
    }
    (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def eos_token_ids(loaded: LoadedModel, tokenizer) -> tuple[int, ...]:
    """Where an answer ends: the model config's EOS ids and the tokenizer's (as the engine)."""
    ids = set(loaded.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def new_head(runner: ModelRunner, hot: torch.Tensor, intermediate: int | None) -> Eagle3Head:
    """A fresh fp32 head for the runner's model: its lm_head starts as the target's rows of
    the draft vocabulary and its norm as the target's final norm (the head's output then
    reads like the target's last hidden state); the rest is torch's default init."""
    target, cfg = runner.model, runner.config
    hf = head_config_dict(cfg, len(hot), intermediate)
    head_cfg = ModelConfig.from_hf_dict(hf | {"architectures": ["LlamaForCausalLM"]})
    head = Eagle3Head(head_cfg, cfg.hidden_size, len(hot), target)
    head.hot_ids = hot.clone()
    with torch.no_grad():
        head.lm_head.weight.copy_(target_head_weight(target)[hot].float())
        head.norm.weight.copy_(target.norm.weight.float())
    return head.float().train()


def head_config_dict(cfg, draft_vocab: int, intermediate: int | None) -> dict:
    """SGLang's / SpecForge's config.json of a one-layer llama_eagle3 head for `cfg`."""
    aux = default_aux_layers(cfg.num_layers)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": intermediate or cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # SGLang's ids are layer outputs: the input of layer i is the output of layer i - 1
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
    }


def _train(
    head: Eagle3Head, data: list[Captured], head_rows: torch.Tensor, config: TrainEagleConfig
) -> list[dict]:
    """AdamW over packed chunks, `epochs` passes; returns per-epoch loss and top-1 accuracy
    of each unrolled step (the head's top draft = the target's top token)."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0)  # fmt: skip
    per_epoch = [pack(data, config, epoch) for epoch in range(config.epochs)]
    total = sum(len(groups) for groups in per_epoch)
    warmup = max(1, total // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * s / total)))
    )
    history = []
    for epoch, groups in enumerate(per_epoch):
        loss_sum, correct, counted = 0.0, [0] * config.ttt_steps, [0] * config.ttt_steps
        for i, group in enumerate(groups):
            if i % 100 == 0:
                logger.info("epoch %d: chunk %d of %d (%.0f CPU s)", epoch, i, len(groups),
                            _cpu_seconds())  # fmt: skip
            chunk = make_chunk([data[j] for j in group], head.hot_ids, head_rows, config.ttt_steps)
            stats = ttt_loss(head, chunk, config.ttt_steps, EAGLE_WINDOW)
            optimizer.zero_grad(set_to_none=True)
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            scheduler.step()
            loss_sum += float(stats.loss.detach())
            correct = [a + b for a, b in zip(correct, stats.correct)]
            counted = [a + b for a, b in zip(counted, stats.counted)]
        accuracy = [round(c / max(n, 1), 4) for c, n in zip(correct, counted)]
        history.append({"epoch": epoch, "loss": round(loss_sum / max(len(groups), 1), 4),
                        "step_accuracy": accuracy})  # fmt: skip
        logger.info("epoch %d: loss %.4f, top-1 accuracy per step %s (%.0f CPU s so far)",
                    epoch, history[-1]["loss"], accuracy, _cpu_seconds())  # fmt: skip
    return history


def pack(data: list[Captured], config: TrainEagleConfig, epoch: int) -> list[list[int]]:
    """The sequences in a seeded order per epoch, grouped into chunks of about
    `chunk_tokens` rows (indices into `data`; a chunk is built when it is trained on)."""
    order = list(range(len(data)))
    random.Random(config.seed * 1000 + epoch).shuffle(order)
    groups, group, used = [], [], 0
    for i in order:
        keep = len(data[i].ids) - _first_row(data[i], config.ttt_steps)
        if group and used + keep > config.chunk_tokens:
            groups.append(group)
            group, used = [], 0
        group.append(i)
        used += keep
    return groups + [group] if group else groups


def _first_row(seq: Captured, steps: int) -> int:
    """A prompt keeps only the rows the answer's window can read."""
    return max(0, seq.prompt_len - 1 - EAGLE_WINDOW - steps)


def make_chunk(
    seqs: list[Captured], hot: torch.Tensor, head_rows: torch.Tensor, steps: int
) -> Chunk:
    """`seqs` packed end to end, with the target's logits over the draft vocabulary `hot`
    (`head_rows` [V_d, hidden]: its LM head's rows) where a row predicts an answer token;
    in_vocab: the answer token is drafted (for greedy answers: the target's top token)."""
    ids, positions, seq_ids, aux, target_row, final = [], [], [], [], [], []
    offset = 0
    for s, seq in enumerate(seqs):
        first, length = _first_row(seq, steps), len(seq.ids)
        pos = torch.arange(first, length)
        ids.append(seq.ids[first:])
        positions.append(pos)
        seq_ids.append(torch.full((length - first,), s, dtype=torch.int64))
        aux.append(seq.aux[first:])
        rel = pos - (seq.prompt_len - 1)  # the row of seq.final, where there is one
        has = (rel >= 0) & (rel < len(seq.final))
        target_row.append(torch.where(has, rel + offset, -1))
        final.append(seq.final)
        offset += len(seq.final)
    targets = torch.cat(final).float() @ head_rows.t()  # [R, V_d]
    answers = torch.cat([seq.ids[seq.prompt_len :] for seq in seqs])
    return Chunk(
        ids=torch.cat(ids), positions=torch.cat(positions), seq=torch.cat(seq_ids),
        aux=torch.cat(aux).float(), target_row=torch.cat(target_row),
        targets=targets, in_vocab=torch.isin(answers, hot),
    )  # fmt: skip


def save_head(head: Eagle3Head, hot: torch.Tensor, runner: ModelRunner, folder: Path) -> Path:
    """config.json + model.safetensors in SGLang's llama_eagle3 names (q/k/v and gate/up
    apart, d2t: draft id -> target id offset, t2d: which target ids are drafted), bf16."""
    folder.mkdir(parents=True, exist_ok=True)
    attn = head.midlayer.self_attn
    tensors = {}
    for name, param in head.named_parameters():
        weight = param.detach().to(torch.bfloat16)
        if name.endswith("qkv_proj.weight"):
            parts = weight.split([attn.q_size, attn.kv_size, attn.kv_size])
            for part, proj in zip(parts, ("q_proj", "k_proj", "v_proj")):
                tensors[name.replace("qkv_proj", proj)] = part
        elif name.endswith("gate_up_proj.weight"):
            for part, proj in zip(weight.chunk(2), ("gate_proj", "up_proj")):
                tensors[name.replace("gate_up_proj", proj)] = part
        else:
            tensors[name] = weight
    t2d = torch.zeros(runner.config.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    tensors["d2t"] = hot - torch.arange(len(hot))
    tensors["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = head_config_dict(runner.config, len(hot), head.config.intermediate_size)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
