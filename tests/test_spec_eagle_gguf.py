"""EAGLE heads over a tied K-quant GGUF target, whose token embedding stays in GGUF blocks
(BlockEmbedding: no dense embed_tokens.weight) and whose LM head is that same block layer:
an EAGLE3 head without embeddings or lm_head of its own (both read from the target) and an
EAGLE head keep greedy outputs and are accepted; deterministic inference runs on such a
model; LlamaForCausalLM.head_weight is the table the blocks hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kquant_gguf import CONFIG, HIDDEN, _needs_blocks, write_kquant_gguf
from test_spec_eagle import _head_config, _midlayer, _save_head
from test_spec_eagle1 import _config, _layer

from conftest import greedy, make_engine
from radixserve.model.quant.block_embedding import BlockEmbedding

VOCAB = 49152  # the default model's tokenizer (the file has none) must fit
PROMPTS = [[(i * 37 + j * 11) % 4000 + 100 for j in range(20 + 7 * i)] for i in range(3)]


def _save_llama(folder):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**(CONFIG | {"vocab_size": VOCAB}), tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _eagle3_echo(folder) -> str:
    """Passes the residual stream after the last layer through (aux ids [0, 0, 1] of two
    layers: the third capture is after layer 1); no embed_tokens, no lm_head: the target's."""
    torch.manual_seed(4)
    tensors = _midlayer(HIDDEN, 0.05)
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    tensors["midlayer.mlp.down_proj.weight"].zero_()
    fc = torch.zeros(HIDDEN, 3 * HIDDEN)
    fc[:, 2 * HIDDEN :] = torch.eye(HIDDEN)
    tensors |= {"fc.weight": fc, "norm.weight": torch.ones(HIDDEN)}
    ids = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}
    config = _head_config(HIDDEN, vocab_size=VOCAB, draft_vocab_size=None, eagle_config=ids)
    return _save_head(folder, tensors, config)


def _eagle1_echo(folder) -> str:
    torch.manual_seed(5)
    tensors = _layer(HIDDEN, 0.05)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    fc = torch.zeros(HIDDEN, 2 * HIDDEN)
    fc[:, HIDDEN:] = torch.eye(HIDDEN)
    tensors |= {"fc.weight": fc, "fc.bias": torch.zeros(HIDDEN)}
    return _save_head(folder, tensors, _config(HIDDEN))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    _needs_blocks()
    root = tmp_path_factory.mktemp("eagle_gguf")
    back = write_kquant_gguf(_save_llama(root / "hf"), root / "tiny.gguf", None, T.Q6_K)
    return {
        "target": str(root / "tiny.gguf"),
        "table": torch.from_numpy(np.ascontiguousarray(back["model.embed_tokens.weight"])),
        "EAGLE3": _eagle3_echo(root / "eagle3"),
        "EAGLE": _eagle1_echo(root / "eagle1"),
    }


@pytest.fixture(scope="module")
def plain(files):
    return make_engine(files["target"], max_total_tokens=2048)


@pytest.fixture(scope="module")
def expected(plain) -> list[list[int]]:
    return [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=greedy(24))]


def test_the_head_weight_of_a_block_embedding_is_its_dequantized_table(files, plain):
    model = plain.runner.model
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.lm_head is not None
    assert not hasattr(model.embed_tokens, "weight")  # no dense table to read
    torch.testing.assert_close(model.head_weight(), files["table"])
    model.lm_head, tied = None, model.lm_head  # the tied branch: the embedding's blocks
    try:
        torch.testing.assert_close(model.head_weight(), files["table"])
    finally:
        model.lm_head = tied


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_eagle_heads_draft_over_a_block_embedding_target(files, expected, algorithm):
    flags = {"speculative_algorithm": algorithm, "speculative_draft_model_path": files[algorithm]}
    spec = make_engine(
        files["target"], max_total_tokens=2048, speculative_adaptive_threshold=0, **flags
    )
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(24))
    assert [o["output_ids"] for o in outputs] == expected
    stats = spec.get_stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    spec.check_integrity()


def test_deterministic_inference_on_a_block_embedding_target(files):
    """Same tokens alone and in a batch (batch-invariant kernels on every row count)."""
    engine = make_engine(
        files["target"], max_total_tokens=2048, enable_deterministic_inference=True
    )
    batch = engine.generate(input_ids=PROMPTS, sampling_params=greedy(12))
    alone = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(12))
    assert batch[2]["output_ids"] == alone["output_ids"] and len(alone["output_ids"]) == 12
