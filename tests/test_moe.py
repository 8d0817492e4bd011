"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, tiny and fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from conftest import (
    SYSTEM,
    TINY,
    VOCAB,
    greedy,
    greedy_generate,
    hf_model,
    make_engine,
    make_runner,
    prompt_ids,
)
from radixserve.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig
from radixserve.config.model import MoEConfig, UnsupportedModelError
from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import hf_weight_shapes
from radixserve.model.loader import load_model, read_hf_config
from radixserve.model.moe import (
    Routing,
    SparseMoeBlock,
    check_ep_size,
    dense_experts,
    grouped_experts,
    route,
)
from radixserve.model.quant import QuantizationError
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.runner import ModelRunner
from radixserve.model.source import builtin_config

MOE = dict(TINY, vocab_size=VOCAB, max_position_embeddings=2048, num_experts_per_tok=2)
CONFIGS = {
    # layer 1 dense (mlp_only_layers), renormalized top-k
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **MOE, head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # layer 0 dense (decoder_sparse_step 2), sigmoid-gated shared expert, no renormalization
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **MOE, num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    ),
    "mixtral": lambda: MixtralConfig(**MOE, num_local_experts=4),
}  # fmt: skip
PROMPTS = [SYSTEM[:40] + prompt_ids(i, 9) for i in range(3)] + [[3, 4, 5]]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_moe")
    folders = {}
    for seed, (arch, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()
        model.save_pretrained(root / arch)
        folders[arch] = str(root / arch)
    return folders


@pytest.fixture(scope="module")
def expected(moe_models) -> dict[str, list[list[int]]]:
    """Our runner's greedy tokens for PROMPTS (the reference driver, no scheduler), per
    architecture; test_greedy_tokens_match_transformers checks them against transformers."""
    return {
        arch: greedy_generate(make_runner(folder), PROMPTS, max_new_tokens=NUM_TOKENS)
        for arch, folder in moe_models.items()
    }


@torch.inference_mode()
def hf_greedy_choices(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax after the prompt and after each of `tokens`, in one forward:
    equal to `tokens` exactly when its own greedy decoding yields them (causal attention)."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


def test_config_reads_sparse_layers_and_routing(moe_models):
    configs = {a: ModelConfig.from_hf_dict(read_hf_config(Path(f))) for a, f in moe_models.items()}
    assert configs["qwen3_moe"].moe.sparse_layers == (0,)
    assert configs["qwen3_moe"].moe.norm_topk_prob and configs["qwen3_moe"].qk_norm
    assert configs["qwen2_moe"].moe.sparse_layers == (1,)
    assert configs["qwen2_moe"].moe.shared_expert_intermediate_size == 48
    assert configs["mixtral"].moe == MoEConfig(4, 2, 128, True, (0, 1))


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_tokens_match_transformers(moe_models, expected, arch):
    reference = hf_model(moe_models[arch])
    for prompt, tokens in zip(PROMPTS, expected[arch]):
        assert len(tokens) == NUM_TOKENS
        assert hf_greedy_choices(reference, prompt, tokens) == tokens


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_engine_cold_warm_and_chunked_match_transformers(moe_models, expected, arch):
    with make_engine(moe_models[arch], chunked_prefill_size=32) as engine:
        cold = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NUM_TOKENS))
        warm = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NUM_TOKENS))
        assert [o["output_ids"] for o in cold] == [o["output_ids"] for o in warm] == expected[arch]
        assert warm[0]["meta_info"]["cached_tokens"] == 48  # 49-token prompt: 3 whole pages
        engine.check_integrity()


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "NGRAM"},
        {"speculative_algorithm": "SELF", "speculative_self_layers": 1},  # the sparse layer
    ],
)
def test_speculative_decoding_keeps_the_greedy_tokens(moe_models, expected, spec):
    with make_engine(moe_models["qwen3_moe"], **spec) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NUM_TOKENS))
        assert [o["output_ids"] for o in out] == expected["qwen3_moe"]
        engine.check_integrity()


def test_tiny_pool_retracts_and_still_matches_a_large_pool(moe_models):
    """Qwen2-MoE: a dense layer, a sparse one with its shared expert."""
    prompts, params = [prompt_ids(i, 24) for i in range(16)], greedy(100)
    with make_engine(moe_models["qwen2_moe"]) as big:
        reference = big.generate(input_ids=prompts, sampling_params=params)
    with make_engine(
        moe_models["qwen2_moe"], max_total_tokens=640, chunked_prefill_size=64
    ) as small:
        initial_free = small.runner.pool.allocator.num_free
        out = small.generate(input_ids=prompts, sampling_params=params)
        assert small.get_stats()["retractions"] > 0
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in reference]
        small.check_integrity()
        assert small.flush_cache()
        assert small.runner.pool.allocator.num_free == initial_free


def _naive_moe(x, w13, w2, routing: Routing) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped paths must meet."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(routing.weights[t], routing.experts[t].tolist()):
            gate, up = (x[t] @ w13[e].t()).chunk(2)
            out[t] += weight * ((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    return out


def test_grouped_and_dense_experts_equal_the_per_token_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=gen)
    w13, w2 = torch.randn(5, 24, 16, generator=gen), torch.randn(5, 16, 12, generator=gen)
    routing = route(torch.randn(11, 5, generator=gen), top_k=3, norm_topk_prob=False)
    reference = _naive_moe(x, w13, w2, routing)
    torch.testing.assert_close(grouped_experts(x, w13, w2, routing), reference)
    torch.testing.assert_close(dense_experts(x, w13, w2, routing, 5), reference)
    halves = [  # expert parallelism: two ranks' parts, experts 0-1 and 2-4, sum to the whole
        grouped_experts(x, w13[:2], w2[:2], routing)
        + grouped_experts(x, w13[2:], w2[2:], routing, first_expert=2),
        dense_experts(x, w13[:2], w2[:2], routing, 5)
        + dense_experts(x, w13[2:], w2[2:], routing, 5, first_expert=2),
    ]
    for parts in halves:
        torch.testing.assert_close(parts, reference)


def test_route_renormalizes_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain, normed = route(logits, 2, False), route(logits, 2, True)
    assert plain.experts.tolist() == normed.experts.tolist() == [[0, 1]]
    assert plain.weights.sum() < 1
    torch.testing.assert_close(normed.weights.sum(), torch.tensor(1.0))


def test_builtin_configs_have_the_public_shapes():
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)):
        config = ModelConfig.from_hf_dict(builtin_config(name))
        shapes = hf_weight_shapes(config)
        params = sum(torch.Size(s).numel() for s in shapes.values())
        moe = config.moe
        expert = 3 * moe.intermediate_size * config.hidden_size
        unused = (moe.num_experts - moe.top_k) * expert * len(moe.sparse_layers)
        assert params == pytest.approx(total, rel=0.01), name
        assert params - unused == pytest.approx(active, rel=0.03), name


def test_refused_options_name_their_flag(moe_models):
    with pytest.raises(QuantizationError, match="--quantization fp8 is not supported"):
        load_model(LoadConfig(model=moe_models["mixtral"], device="cpu", quantization="fp8"))
    with pytest.raises(ValueError, match="--enable-deterministic-inference"):
        load_model(
            LoadConfig(
                model=moe_models["mixtral"], device="cpu", enable_deterministic_inference=True
            )
        )
    moe = MoEConfig(6, 2, 32, True, (0,))
    with pytest.raises(ValueError, match="--ep-size 4 does not divide 6 experts"):
        SparseMoeBlock(64, moe, TPGroup(rank=0, size=4))
    bad = builtin_config("mixtral-8x7b") | {"num_experts_per_tok": 9}
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(bad)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_dummy_weights_fill_every_expert(moe_models, arch):
    """`--load-format dummy` draws every HF-named tensor (Mixtral's w1/w3/w2, the shared
    expert) and fills every stacked expert parameter; seeded, so two loads agree."""
    first = make_runner(moe_models[arch], load_format="dummy")
    tokens = greedy_generate(first, PROMPTS[-1:], max_new_tokens=4)
    again = make_runner(moe_models[arch], load_format="dummy")
    assert greedy_generate(again, PROMPTS[-1:], max_new_tokens=4) == tokens


def test_expert_parallel_two_ranks_give_the_tokens_of_one(moe_models, expected):
    """--tp-size 2 --ep-size 2 (gloo): attention and the dense layer split by heads and
    columns, the experts three per rank, the shared expert on rank 0; tokens as one rank's."""
    from radixserve.model.tp_runner import TPModelRunner

    runner = TPModelRunner.create(
        LoadConfig(model=moe_models["qwen2_moe"], device="cpu"),
        CacheConfig(page_size=16, max_total_tokens=1024),
        ParallelConfig(tp_size=2, ep_size=2),
    )
    try:
        assert runner.model.layers[1].mlp.w13.shape[0] == 3  # rank 0's half of 6 experts
        tokens = greedy_generate(runner, PROMPTS, max_new_tokens=NUM_TOKENS)
    finally:
        runner.close()
    assert tokens == expected["qwen2_moe"]


def test_expert_parallel_sizes_are_checked_at_start(moe_models):
    from radixserve.model.tp_runner import TPModelRunner

    with pytest.raises(ValueError, match="--ep-size must be 1 or --tp-size"):
        ParallelConfig(tp_size=2, ep_size=3).verify()
    config = ModelConfig.from_hf_dict(read_hf_config(Path(moe_models["qwen2_moe"])))
    with pytest.raises(ValueError, match="needs --ep-size 2"):
        check_ep_size(config, tp_size=2, ep_size=1)
    load = LoadConfig(model=moe_models["qwen2_moe"], device="cpu")
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    with pytest.raises(ValueError, match="--ep-size 4 does not divide the model's 6 experts"):
        TPModelRunner.create(load, cache, ParallelConfig(tp_size=4, ep_size=4))  # no rank spawned


@pytest.mark.parametrize("method, arch", [("int8", "qwen2_moe"), ("int4", "qwen3_moe")])
def test_quantized_experts_run_their_dequantized_weights(moe_models, method, arch):
    """--quantization int8 / int4: each expert's gate_up and down (and the shared expert's
    projections) become quantized layers; the routed MLP's output is the grouped experts' of
    the weights those layers dequantize to, and the logits stay near the fp model's."""
    load = LoadConfig(model=moe_models[arch], device="cpu", quantization=method)
    model = load_model(load).model
    mlp = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert mlp.w13 is None and len(mlp.gate_up_layers) == mlp.moe.num_experts
    assert isinstance(mlp.down_layers[-1], QUANTIZED_LAYER[method])
    w13 = torch.stack([part.dequantize(torch.float32) for part in mlp.gate_up_layers])
    w2 = torch.stack([part.dequantize(torch.float32) for part in mlp.down_layers])
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = grouped_experts(x, w13, w2, route(x @ mlp.gate.t(), 2, mlp.moe.norm_topk_prob))
        if mlp.shared_expert is not None:
            assert isinstance(mlp.shared_expert.down_proj, QUANTIZED_LAYER[method])
            expected += torch.sigmoid(x @ mlp.shared_expert_gate.t()) * mlp.shared_expert(x)
        torch.testing.assert_close(mlp(x), expected, atol=2e-3, rtol=2e-2)
    ours, fp = (
        prefill_logits(LoadConfig(model=moe_models[arch], device="cpu", quantization=m))
        for m in (method, "none")
    )
    assert (ours - fp).abs().mean() < LOGITS_TOLERANCE[method] * fp.abs().mean()


def test_int4_names_the_expert_layer_it_cannot_group(moe_models):
    """Qwen2-MoE's 48-wide shared expert holds no whole group of 32: an error at start."""
    load = LoadConfig(model=moe_models["qwen2_moe"], device="cpu", quantization="int4")
    with pytest.raises(QuantizationError, match="in_features=48 of mlp.shared_expert.down_proj"):
        load_model(load)


QUANTIZED_LAYER = {"int8": Int8WeightOnlyLinear, "int4": Int4WeightOnlyLinear}
LOGITS_TOLERANCE = {"int8": 0.05, "int4": 0.4}  # mean error / mean |fp logit|, measured on
# these random tiny models: int8 0.02, int4 0.28 (a mean: a token whose top-k flips moves a lot)


def prefill_logits(load: LoadConfig) -> torch.Tensor:
    """Every position's logits of PROMPTS[0], one prefill through the model runner."""
    runner = ModelRunner.create(load, CacheConfig(max_total_tokens=256))
    table = runner.pool.extend_page_table([], len(PROMPTS[0]))
    batch = ForwardBatch.build([PROMPTS[0]], [0], [table], 16, return_all_logits=True)
    return runner.forward(batch).all
