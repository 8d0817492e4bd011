"""EAGLE (EAGLE-1/2 heads in SGLang's llama_eagle.py layout: fc over cat(token embedding,
the target's final-normed hidden state), one decoder layer without input_layernorm, the
target's embeddings and LM head) built here for a tiny random Llama: the runner captures
the feature EAGLE reads, greedy outputs are identical to plain decoding with chains and
trees, a head built to agree with the target is accepted, and heads that do not fit the
target fail at start naming the flag."""

from __future__ import annotations

import pytest
import torch
from test_spec_eagle import HIDDEN, _save_head, _save_target
from test_spec_eagle import _echo_head as _eagle3_echo_head

from conftest import greedy, hf_model, make_engine, make_runner, prompt_ids
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import FINAL_HIDDEN

INTER = 2 * HIDDEN


def _config(hidden: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
    }


def _layer(hidden: int, scale: float) -> dict[str, torch.Tensor]:
    kv = hidden // 2
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (2 * hidden, hidden),
        "mlp.up_proj": (2 * hidden, hidden),
        "mlp.down_proj": (hidden, 2 * hidden),
    }
    out = {f"layers.0.{k}.weight": torch.randn(s) * scale for k, s in shapes.items()}
    return out | {"layers.0.post_attention_layernorm.weight": torch.ones(hidden)}


def _random_head(folder, hidden: int = HIDDEN, target_hidden: int = HIDDEN) -> str:
    torch.manual_seed(3)
    tensors = _layer(hidden, 0.1) | {
        "fc.weight": torch.randn(hidden, 2 * target_hidden) * 0.1,
        "fc.bias": torch.randn(hidden) * 0.1,
    }
    return _save_head(folder, tensors, _config(hidden))


def _echo_head(folder) -> str:
    """fc passes the feature half through and the layer adds nothing, so the target's LM
    head over it gives the target's own token at the feature's position: the head drafts
    the last token again, accepted wherever the target repeats it. Its checkpoint also
    holds embed_tokens (as EAGLE's do): the target's are used."""
    tensors = _layer(HIDDEN, 0.1)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    fc = torch.zeros(HIDDEN, 2 * HIDDEN)
    fc[:, HIDDEN:] = torch.eye(HIDDEN)  # cat(embedding, feature): the second half
    tensors |= {"fc.weight": fc, "fc.bias": torch.zeros(HIDDEN)}
    tensors["embed_tokens.weight"] = torch.randn(4096, HIDDEN)
    return _save_head(folder, {f"model.{k}": v for k, v in tensors.items()}, _config(HIDDEN))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle1")
    return {
        "target": _save_target(root / "target"),
        "random": _random_head(root / "random"),
        "echo": _echo_head(root / "echo"),
        "wide": _random_head(root / "wide", hidden=2 * HIDDEN, target_hidden=2 * HIDDEN),
        "eagle3_echo": _eagle3_echo_head(root / "eagle3_echo"),
    }


def _eagle(path: str, **extra) -> dict:
    flags = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": path}
    return flags | {"speculative_adaptive_threshold": 0} | extra


PROMPTS = [prompt_ids(i, 20 + 11 * i) for i in range(3)]


@pytest.fixture(scope="module")
def expected(models) -> list[list[int]]:
    plain = make_engine(models["target"])
    return [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=greedy(30))]


@torch.inference_mode()
def test_runner_captures_the_final_normed_hidden_state(models):
    """EAGLE's feature: the LM head's input (HF's last hidden_states entry, after the norm)."""
    runner = make_runner(models["target"])
    prompt = prompt_ids(0, 12)
    pages = runner.pool.allocator.allocate(1).tolist()
    batch = ForwardBatch.build([prompt], [0], [pages], runner.pool.page_size)
    runner.aux_layers = (FINAL_HIDDEN,)
    aux = runner.forward(batch).aux_hidden
    reference = hf_model(models["target"])(torch.tensor([prompt]), output_hidden_states=True)
    torch.testing.assert_close(aux, reference.hidden_states[-1][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("head", "flags"),
    [
        ("echo", {"speculative_num_steps": 3}),
        ("random", {"speculative_num_steps": 3}),
        (
            "echo",
            {
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 2,
                "speculative_num_draft_tokens": 6,
            },
        ),
    ],  # fmt: skip
    ids=["echo-chain", "random-chain", "echo-tree"],
)
def test_eagle_keeps_greedy_outputs_and_an_agreeing_head_is_accepted(models, expected, head, flags):
    spec = make_engine(models["target"], **_eagle(models[head], **flags))
    initial_free = spec.runner.pool.allocator.num_free
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    assert [o["output_ids"] for o in outputs] == expected
    stats = spec.get_stats()
    assert stats["spec_draft_tokens"] > 0
    if head == "echo":
        assert stats["spec_accepted_tokens"] > 0
        drafted_by = {s for o in outputs for s in o["meta_info"]["spec_drafter_verify_ct"]}
        assert "EAGLE" in drafted_by
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_bad_eagle_heads_fail_at_start_naming_the_flag(models, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_model_path.*hidden states of size"):
        make_engine(models["target"], **_eagle(models["wide"]))
    with pytest.raises(ValueError, match="speculative_draft_model_path.*no config.json"):
        make_engine(models["target"], **_eagle(str(tmp_path)))
    with pytest.raises(ValueError, match="EAGLE needs --speculative-draft-model-path"):
        make_engine(models["target"], speculative_algorithm="EAGLE")


def test_heads_reading_a_batch_invariant_lm_head_keep_greedy_outputs(models, expected):
    """--enable-deterministic-inference packs the tied LM head (BatchInvariantLinear): an
    EAGLE3 head without lm_head reads its weight through LlamaForCausalLM.head_weight."""
    flags = {"speculative_algorithm": "EAGLE3", "enable_deterministic_inference": True}
    path = models["eagle3_echo"]
    spec = make_engine(models["target"], speculative_draft_model_path=path, **flags)
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    assert [o["output_ids"] for o in outputs] == expected
    assert spec.get_stats()["spec_accepted_tokens"] > 0
