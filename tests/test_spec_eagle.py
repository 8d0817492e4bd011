"""EAGLE3: heads in SGLang's layout (as SpecForge writes them) built here for a tiny random
Llama; greedy outputs identical to plain decoding cold, warm and under retraction, sampled
requests run, and heads that do not fit the target fail at start naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, greedy, hf_model, make_engine, make_runner, prompt_ids
from radixserve.engine.speculative.row_buffer import RowBuffer
from radixserve.forward_batch import ForwardBatch
from radixserve.model.quant.batch_invariant import BatchInvariantLinear, dense_kernels

NUM_LAYERS = 4
HIDDEN = TINY["hidden_size"]
DRAFT_VOCAB = 4096
LINEARS = (torch.nn.Linear, BatchInvariantLinear)


def _save_target(folder) -> str:
    """Tied embeddings: this random target often repeats its last token (what the echo
    head drafts), and as often does not."""
    torch.manual_seed(1)
    overrides = {"vocab_size": VOCAB, "max_position_embeddings": 2048}
    layers = {"num_hidden_layers": NUM_LAYERS, "tie_word_embeddings": True}
    config = LlamaConfig(**(TINY | overrides | layers))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def _head_config(hidden: int, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    } | extra


def _midlayer(hidden: int, scale: float) -> dict[str, torch.Tensor]:
    head_dim, kv = hidden // 4, 2 * hidden // 4
    shapes = {
        "q_proj": (hidden, 2 * hidden),
        "k_proj": (kv, 2 * hidden),
        "v_proj": (kv, 2 * hidden),
        "o_proj": (hidden, 4 * head_dim),
    }
    out = {f"midlayer.self_attn.{k}.weight": torch.randn(s) * scale for k, s in shapes.items()}
    for name, shape in (("gate", (2 * hidden, hidden)), ("up", (2 * hidden, hidden))):
        out[f"midlayer.mlp.{name}_proj.weight"] = torch.randn(shape) * scale
    out["midlayer.mlp.down_proj.weight"] = torch.randn(hidden, 2 * hidden) * scale
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{norm}.weight"] = torch.ones(hidden)
    return out


def _save_head(folder, tensors: dict, config: dict) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def _random_head(folder, hidden: int = HIDDEN, target_hidden: int = HIDDEN) -> str:
    """A random head with its own lm_head over DRAFT_VOCAB ids mapped by d2t / t2d."""
    torch.manual_seed(2)
    hot = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    tensors = _midlayer(hidden, 0.1) | {
        "fc.weight": torch.randn(hidden, 3 * target_hidden) * 0.1,
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(DRAFT_VOCAB, hidden) * 0.1,
        "d2t": hot - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    return _save_head(folder, tensors, _head_config(hidden))


def _echo_head(folder, num_layers: int = NUM_LAYERS) -> str:
    """A head whose midlayer adds nothing and whose fc passes the target's final residual
    stream through (aux layer id L - 1: after the last layer; L = `num_layers`, the
    target's), with the target's LM head (none of its own): it drafts the target's token at
    the previous position, so it is accepted wherever the target repeats a token."""
    tensors = _midlayer(HIDDEN, 0.1)
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    tensors["midlayer.mlp.down_proj.weight"].zero_()
    fc = torch.zeros(HIDDEN, 3 * HIDDEN)
    fc[:, 2 * HIDDEN :] = torch.eye(HIDDEN)
    tensors |= {"fc.weight": fc, "norm.weight": torch.ones(HIDDEN)}
    layer_ids = {"eagle_aux_hidden_state_layer_ids": [0, 1, num_layers - 1]}
    config = _head_config(HIDDEN, draft_vocab_size=None, eagle_config=layer_ids)
    return _save_head(folder, tensors, config)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    return {
        "target": _save_target(root / "target"),
        "random": _random_head(root / "random"),
        "echo": _echo_head(root / "echo"),
        "wide": _random_head(root / "wide", hidden=2 * HIDDEN, target_hidden=2 * HIDDEN),
    }


@torch.inference_mode()
def test_runner_captures_the_residual_stream_entering_the_aux_layers(models):
    """aux layer i = HF's hidden_states[i] (the input of layer i), for SGLang's default
    capture points (2, L/2, L-3); a runner without aux layers returns none."""
    runner = make_runner(models["target"])
    prompt = prompt_ids(0, 12)
    pages = runner.pool.allocator.allocate(1).tolist()
    batch = ForwardBatch.build([prompt], [0], [pages], runner.pool.page_size)
    assert runner.forward(batch).aux_hidden is None
    runner.aux_layers = (2, 2, 1)
    aux = runner.forward(batch).aux_hidden  # [12, 3 * hidden]
    reference = hf_model(models["target"])(torch.tensor([prompt]), output_hidden_states=True)
    states = reference.hidden_states
    expected = torch.cat([states[2][0], states[2][0], states[1][0]], dim=-1)
    torch.testing.assert_close(aux, expected, rtol=1e-4, atol=1e-4)


def _eagle(path: str, **extra) -> dict:
    flags = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": path}
    return flags | {"speculative_adaptive_threshold": 0} | extra


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


@pytest.fixture(scope="module")
def expected(models) -> list[list[int]]:
    prompts = [prompt_ids(i, 20 + 11 * i) for i in range(4)]
    plain = make_engine(models["target"])
    return _ids(plain.generate(input_ids=prompts, sampling_params=greedy(30)))


@pytest.mark.parametrize("head", ["random", "echo"])
def test_eagle3_keeps_greedy_outputs_cold_and_warm(models, expected, head):
    prompts = [prompt_ids(i, 20 + 11 * i) for i in range(4)]
    spec = make_engine(models["target"], **_eagle(models[head], speculative_num_steps=3))
    initial_free = spec.runner.pool.allocator.num_free
    cold = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    warm = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    assert _ids(cold) == _ids(warm) == expected
    stats = spec.get_stats()
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_draft_tokens"] <= 3 * stats["spec_verify_steps"]
    if head == "echo":
        assert stats["spec_accepted_tokens"] > 0
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


@torch.inference_mode()
def _reference_chain(head, target, seq: list[int], num_steps: int) -> list[int]:
    """The chain recomputed from scratch: the HF target's hidden states entering layers
    (2, 2, 1) (SGLang's default for 4 layers) of the whole sequence, the head over all
    columns with a causal mask each step (no kept K/V, no padding, no batch)."""
    states = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[2][0], states[2][0], states[1][0]], dim=-1)[:-1]
    hidden, tokens = head.fuse(aux)[None], torch.tensor([seq[1:]])
    drafts = []
    for _ in range(num_steps):
        width = tokens.shape[1]
        mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None]
        step = head(hidden, tokens, torch.arange(width)[None], None, mask)
        drafts.append(int(step.logits[0].argmax()))
        hidden = torch.cat([hidden, step.hidden[:, -1:]], dim=1)
        tokens = torch.cat([tokens, torch.tensor([[drafts[-1]]])], dim=1)
    return drafts


def test_eagle3_drafts_equal_the_head_recomputed_from_scratch(models):
    """Kept K/V, pending rows cut after rejected drafts, padding of a batch of two: each
    proposal of a cold run (sequences shorter than the window) is the from-scratch chain,
    with the head's linears on the packed dense kernel (pack_for_cpu) where it builds."""
    spec = make_engine(models["target"], **_eagle(models["random"], speculative_num_steps=3))
    drafter = spec.scheduler.drafter
    linears = [m for m in drafter.head.modules() if isinstance(m, LINEARS)]
    assert len(linears) == 6  # fc, qkv, o, gate_up, down, lm_head
    if dense_kernels() is not None:
        assert all(isinstance(m, BatchInvariantLinear) for m in linears)
    proposals = []
    propose_all = drafter.propose_all

    def recording(reqs, max_tokens=None):
        drafts = propose_all(reqs, max_tokens)
        proposals.extend((r.seq_ids(), d.tokens) for r, d in zip(reqs, drafts))
        return drafts

    drafter.propose_all = recording
    prompts = [prompt_ids(0, 20), prompt_ids(1, 31)]
    spec.generate(input_ids=prompts, sampling_params=greedy(24))
    target = hf_model(models["target"])
    # 3 steps, fewer only where a request keeps fewer (its last tokens before max_new_tokens)
    assert len(proposals) > 10 and all(1 <= len(d) <= 3 for _, d in proposals)
    assert sum(len(d) == 3 for _, d in proposals) > 10
    for seq, draft in proposals:
        assert draft == _reference_chain(drafter.head, target, seq, len(draft))


def test_a_backed_off_request_probes_with_one_head_step(models):
    """The random head's drafts do not pay, so its request backs off and retries with
    one-token probes: the head runs one step for those (not num_steps, two of them cut)."""
    flags = _eagle(models["random"], speculative_num_steps=3, speculative_adaptive_threshold=1)
    spec = make_engine(models["target"], **flags)
    drafter = spec.scheduler.drafter
    head, steps, calls = drafter.head, [], []
    forward, propose_all = head.forward, drafter.propose_all
    head.forward = lambda *args, **kwargs: (steps.append(1), forward(*args, **kwargs))[1]

    def recording(reqs, max_tokens=None):
        before = len(steps)
        drafts = propose_all(reqs, max_tokens)
        calls.append((list(max_tokens), len(steps) - before, [len(d.tokens) for d in drafts]))
        return drafts

    drafter.propose_all = recording
    spec.generate(input_ids=[prompt_ids(0, 20)], sampling_params=greedy(60))
    probes = [c for c in calls if c[0] == [1]]
    full = [c for c in calls if c[0] == [3]]
    assert len(probes) >= 2 and full, calls
    assert all(c[1:] == (1, [1]) for c in probes), probes
    assert all(c[1:] == (3, [3]) for c in full), full


def test_row_buffer_appends_cuts_and_grows_like_a_list():
    """EAGLE's pending rows (RowBuffer) against a list of the same rows."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 3, generator=gen)
    buffer, model = RowBuffer(rows), list(rows)
    for step in range(200):
        new = torch.randn(step % 4 + 1, 3, generator=gen)
        at = len(model) - step % 3 if step % 5 else len(model)  # a rejected tail is cut
        at = max(at, 0)
        buffer.put(at, new)
        model = model[:at] + list(new)
        if len(model) > 40:
            buffer.drop_front(len(model) - 40)
            model = model[len(model) - 40 :]
        if step % 50 == 49:
            buffer.clear()
            model = []
        assert len(buffer) == len(model)
        assert torch.equal(buffer.rows, torch.stack(model) if model else rows[:0])
    with pytest.raises(ValueError, match="at must be within"):
        buffer.put(len(model) + 1, new)


def test_tiny_pool_retracts_requests_drafting_with_eagle3(models):
    prompts = [prompt_ids(i, 24) for i in range(10)]
    plain = make_engine(models["target"])
    reference = _ids(plain.generate(input_ids=prompts, sampling_params=greedy(60)))
    small = make_engine(
        models["target"],
        max_total_tokens=384,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        **_eagle(models["echo"]),
    )
    assert _ids(small.generate(input_ids=prompts, sampling_params=greedy(60))) == reference
    stats = small.get_stats()
    assert stats["retractions"] > 0 and stats["spec_draft_tokens"] > 0
    small.check_integrity()


def test_sampled_requests_draft_with_eagle3_reproducibly(models):
    """Same seed, same cache state, same tokens (a prefix hit shortens the head's window,
    so a warm run may draft, and so sample, otherwise: still from the target's p)."""
    spec = make_engine(models["target"], **_eagle(models["random"]))
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 24, "sampling_seed": 7}
    first = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    assert spec.flush_cache()
    again = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    assert first["output_ids"] == again["output_ids"] and len(first["output_ids"]) == 24
    assert first["meta_info"]["spec_draft_token_num"] > 0


def test_eagle3_mixed_batch_stops_and_max_new_tokens_are_exact(models):
    """Greedy requests beside a sampled one in the same batch keep plain decoding's tokens;
    stop tokens, stop strings, max_new_tokens and a grammar end and shape them exactly as
    plain decoding does."""
    prompt = prompt_ids(3, 40)
    plain = make_engine(models["target"])
    spec = make_engine(models["target"], **_eagle(models["echo"]))
    reference = plain.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]
    stop_text = plain.tokenizer.decode(reference[20:22])
    sampled = {"temperature": 1.0, "max_new_tokens": 30, "sampling_seed": 3}
    cases = [
        greedy(11),
        greedy(40, stop_token_ids=[reference[17]], ignore_eos=False),
        greedy(40, stop=[stop_text]),
        greedy(12, regex="(ab|a)+"),
    ]
    expected = plain.generate(input_ids=[prompt] * 4, sampling_params=cases)
    outputs = spec.generate(
        input_ids=[prompt] * 4 + [prompt_ids(5, 30)], sampling_params=[*cases, sampled]
    )
    for out, want in zip(outputs, expected):
        assert out["output_ids"] == want["output_ids"] and out["text"] == want["text"]
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert len(outputs[4]["output_ids"]) == 30
    assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_bad_eagle3_heads_and_flags_fail_at_start_naming_the_flag(models):
    with pytest.raises(ValueError, match="speculative_draft_model_path.*hidden states of size"):
        make_engine(models["target"], **_eagle(models["wide"]))
    with pytest.raises(ValueError, match="speculative_eagle_topk must be >= 1"):
        make_engine(models["target"], **_eagle(models["random"], speculative_eagle_topk=0))
    with pytest.raises(ValueError, match="EAGLE3 needs --speculative-draft-model-path"):
        make_engine(models["target"], speculative_algorithm="EAGLE3")
    with pytest.raises(ValueError, match="speculative_eagle_topk needs"):
        make_engine(models["target"], speculative_algorithm="NGRAM", speculative_eagle_topk=1)
