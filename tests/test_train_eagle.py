"""`radixserve train-eagle` end to end on a tiny random Llama with SmolLM2's vocabulary: the
CLI generates the model's own answers, captures its aux hidden states, trains a head with
the training-time test and writes it in SGLang's llama_eagle3 layout; the Engine loads it
and keeps greedy outputs identical. The unrolled training forward is checked against the
head recomputed from scratch as the drafter runs it; the default model gets the shipped
head (EAGLE3 without a path), any other target still needs the flag."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, greedy, make_engine, prompt_ids
from radixserve.cli import main
from radixserve.config import (
    CacheConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    TrainEagleConfig,
)
from radixserve.engine.speculative import with_default_head
from radixserve.forward_batch import ForwardBatch
from radixserve.model.eagle3 import Eagle3Head, default_aux_layers
from radixserve.model.runner import ModelRunner
from radixserve.model.source import default_eagle3_head
from radixserve.train.distill import answer_and_capture
from radixserve.train.ttt import Chunk, ttt_loss, window_mask

DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_eagle")
    torch.manual_seed(1)
    layers = {"num_hidden_layers": 4, "tie_word_embeddings": True}
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB, "max_position_embeddings": 2048} | layers))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "target")
    flags = ["--num-prompts", "8", "--max-new-tokens", "24", "--epochs", "3",
             "--draft-vocab-size", str(DRAFT_VOCAB), "--max-total-tokens", "4096"]  # fmt: skip
    target, head = str(root / "target"), str(root / "head")
    assert main(["train-eagle", "--model", target, "--output", head, *flags]) == 0
    return {"target": target, "head": head}


def test_the_head_is_written_in_sglang_layout_with_its_record(trained):
    folder = trained["head"]
    config = json.loads(open(f"{folder}/config.json").read())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (TINY["hidden_size"], 3 * TINY["hidden_size"])
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    hot = d2t + torch.arange(DRAFT_VOCAB)
    assert t2d.shape == (VOCAB,) and torch.equal(torch.nonzero(t2d).flatten(), hot)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"midlayer.self_attn.{proj}.weight" in names
    assert {"midlayer.mlp.gate_proj.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= names
    record = json.loads(open(f"{folder}/training.json").read())
    assert record["num_sequences"] == 8 and len(record["data_sha256"]) == 64
    losses = [epoch["loss"] for epoch in record["epoch_losses"]]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns the answers it trains on
    first, last = (epoch["step_accuracy"][0] for epoch in record["epoch_losses"][::2])
    assert last > first  # and agrees with the target more often


def test_the_trained_head_keeps_greedy_outputs_identical(trained):
    prompts = [prompt_ids(i, 20 + 7 * i) for i in range(3)]
    expected = make_engine(trained["target"]).generate(
        input_ids=prompts, sampling_params=greedy(24)
    )
    flags = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": trained["head"],
             "speculative_adaptive_threshold": 0}  # fmt: skip
    spec = make_engine(trained["target"], **flags)
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(24))
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in expected]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outputs)
    assert spec.get_stats()["spec_draft_tokens"] > 0


def test_answers_capture_what_a_separate_forward_over_them_computes(trained):
    """The rows captured while the target answers (prefill + decode steps, batched) are the
    aux and final hidden states one forward over each finished sequence computes, and the
    answers are the Engine's greedy ones."""
    prompts = [prompt_ids(i, 9 + 5 * i) for i in range(3)]
    runner = ModelRunner.create(LoadConfig(model=trained["target"]),
                                CacheConfig(max_total_tokens=1024, page_size=16))  # fmt: skip
    data = answer_and_capture(runner, prompts, 12, 0.0, 0, (), batch_size=2)
    expected = make_engine(trained["target"]).generate(input_ids=prompts,
                                                       sampling_params=greedy(12))  # fmt: skip
    assert [s.ids[s.prompt_len :].tolist() for s in data] == [o["output_ids"] for o in expected]
    runner.aux_layers = default_aux_layers(runner.config.num_layers)
    for seq in data:
        pages = runner.pool.extend_page_table([], len(seq.ids))
        batch = ForwardBatch.build([seq.ids.tolist()], [0], [pages], 16)
        final, aux = runner.forward_hidden(batch)
        runner.pool.allocator.free(pages)
        assert seq.aux.shape == aux.shape and not seq.aux[-1].any()  # the last never entered
        close = {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(seq.aux[:-1].float(), aux[:-1], **close)
        torch.testing.assert_close(seq.final.float(), final[seq.prompt_len - 1 : -1], **close)


def test_bad_training_options_fail_naming_the_flag():
    with pytest.raises(ValueError, match="--generate-batch must be >= 1"):
        TrainEagleConfig(generate_batch=0)
    with pytest.raises(ValueError, match="--chunk-tokens must be >= 1"):
        TrainEagleConfig(chunk_tokens=0)


def test_sampled_answers_follow_the_seed(trained):
    runner = ModelRunner.create(LoadConfig(model=trained["target"]),
                                CacheConfig(max_total_tokens=1024, page_size=16))  # fmt: skip
    prompts = [prompt_ids(i, 11) for i in range(2)]
    runs = [answer_and_capture(runner, prompts, 10, 1.0, seed, (), 2) for seed in (3, 3, 4)]
    ids = [[s.ids.tolist() for s in run] for run in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def _tiny_head() -> Eagle3Head:
    torch.manual_seed(0)
    target = torch.nn.Module()
    target.embed_tokens = torch.nn.Embedding(100, 64)
    target.config = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "max_position_embeddings": 512,
    })  # fmt: skip
    head = Eagle3Head(target.config, 64, 100, target).float()
    for param in head.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return head


@torch.no_grad()
@pytest.mark.parametrize("window", [64, 8])
def test_the_unrolled_training_forward_is_the_drafters_chain(window):
    """Step k of the training-time test at row i = draft step k + 1 of a chain proposed
    after x_0 .. x_{i+1}, recomputed from scratch (all columns, the window's mask) as
    test_spec_eagle checks the drafter against; window 8 < 20 rows: the blocked attention."""
    head, n, steps = _tiny_head(), 20, 3
    ids, aux, rows = torch.randint(0, 100, (n,)), torch.randn(n, 192), torch.arange(n)
    chunk = Chunk(ids, rows, torch.zeros(n, dtype=torch.int64), aux, rows, torch.randn(n, 100),
                  torch.ones(n, dtype=torch.bool))  # fmt: skip
    logits = []
    lm_head = head.lm_head.forward
    head.lm_head.forward = lambda x: logits.append(lm_head(x)) or logits[-1]
    ttt_loss(head, chunk, steps, window=window)
    del head.lm_head.forward
    for i in (0, 6, 13, n - 2 - steps):
        hidden, tokens = head.fuse(aux[: i + 1])[None], ids[1 : i + 2][None]
        for k in range(steps):
            width = tokens.shape[1]
            query = torch.arange(width).clamp(max=i)[:, None]  # a chain row sees as row i
            back = query - torch.arange(width)[None]
            mask = torch.ones(width, width, dtype=torch.bool).tril() & (back < window)
            step = head(hidden, tokens, torch.arange(width)[None], None, mask[None, None])
            torch.testing.assert_close(logits[k][i], step.logits[0], rtol=1e-4, atol=1e-4)
            hidden = torch.cat([hidden, step.hidden[:, -1:]], dim=1)
            tokens = torch.cat([tokens, ids[i + 2 + k].view(1, 1)], dim=1)


def test_the_window_mask_is_the_dense_one_in_blocks():
    seq = torch.tensor([0] * 11 + [1] * 3 + [2] * 9)
    window, n = 4, len(seq)
    blocked = window_mask(seq, window)
    back = torch.arange(n)[:, None] - torch.arange(n)[None]
    dense = (seq[:, None] == seq[None]) & (back >= 0) & (back < window)
    for row in range(n):
        b, r = divmod(row, window)
        cols = torch.arange(2 * window) + (b - 1) * window
        inside = (cols >= 0) & (cols < n)
        assert not blocked[b, r][~inside].any()
        assert torch.equal(blocked[b, r][inside], dense[row, cols[inside]])


def test_eagle3_without_a_path_takes_the_shipped_head_on_the_default_model_only(trained):
    eagle = SchedulerConfig(speculative_algorithm="EAGLE3")
    default = with_default_head(LoadConfig(), eagle)
    assert default.speculative_draft_model_path == str(default_eagle3_head())
    assert (default_eagle3_head() / "config.json").is_file()
    assert with_default_head(LoadConfig(model=trained["target"]), eagle) is eagle
    with pytest.raises(ValueError, match="EAGLE3 needs --speculative-draft-model-path"):
        make_engine(trained["target"], speculative_algorithm="EAGLE3")
