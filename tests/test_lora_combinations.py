"""LoRA beside other features. Speculative decoding: NGRAM's and SUFFIX's drafts are verified
by each adapter's own forward, so a mixed batch still gives PEFT's tokens; SUFFIX drafts an
adapter's requests only from that adapter's outputs; model-based drafters are refused at
start. The in-memory host tier: an adapter's evicted pages come back to it, never to another
adapter; a tier on disk is refused."""

from __future__ import annotations

import pytest
from lora_data import NUM_NEW, build_lora_models, peft_references

from conftest import greedy, make_engine, prompt_ids
from radixserve import Engine

NAMES = [None, "a1", "a2"]


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    return build_lora_models(tmp_path_factory.mktemp("lora_spec"))


def spec_engine(lora_models, algorithm: str) -> Engine:
    base_folder, folders = lora_models
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    return make_engine(str(base_folder), lora_paths=paths, max_loras_per_batch=3,
                       speculative_algorithm=algorithm,
                       speculative_adaptive_threshold=0)  # fmt: skip


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_drafts_under_adapters_give_pefts_tokens(lora_models, algorithm):
    prompts, expected = peft_references(lora_models)
    engine = spec_engine(lora_models, algorithm)
    try:
        accepted = {name: 0 for name in NAMES}
        for _ in range(2):  # SUFFIX: the second round drafts from the first round's outputs
            for i, prompt in enumerate(prompts):
                results = engine.generate(input_ids=[prompt] * 3, lora_path=NAMES,
                                          sampling_params=greedy(NUM_NEW))  # fmt: skip
                for name, result in zip(NAMES, results):
                    assert result["output_ids"] == expected[name][i], (algorithm, name, i)
                    accepted[name] += result["meta_info"]["spec_accept_token_num"]
        engine.core.check_integrity()
    finally:
        engine.shutdown()
    if algorithm == "SUFFIX":  # each adapter's second round repeats its own first
        assert all(accepted[name] >= NUM_NEW for name in NAMES), accepted


def test_suffix_never_drafts_from_another_adapters_outputs(lora_models):
    """The same adapter folder loaded under two names gives the same tokens; only a repeat
    under the same name drafts from the first run's output."""
    base_folder, folders = lora_models
    prompts, expected = peft_references(lora_models)
    paths = [f"a1={folders['a1']}", f"a1_copy={folders['a1']}"]
    engine = make_engine(str(base_folder), lora_paths=paths, speculative_algorithm="SUFFIX",
                         speculative_adaptive_threshold=0)  # fmt: skip
    try:
        runs = [
            engine.generate(input_ids=prompts[0], lora_path=name, sampling_params=greedy(NUM_NEW))
            for name in ("a1", "a1_copy", "a1")
        ]
    finally:
        engine.shutdown()
    assert all(run["output_ids"] == expected["a1"][0] for run in runs)
    first, copy, again = (run["meta_info"]["spec_accept_token_num"] for run in runs)
    assert copy == first  # nothing of a1's output in a1_copy's store
    assert again > first


@pytest.mark.parametrize("algorithm", ["SELF", "AUTO"])
def test_model_drafters_are_refused_with_lora(lora_models, algorithm):
    with pytest.raises(ValueError, match=r"works with --speculative-algorithm NGRAM or SUFFIX"):
        spec_engine(lora_models, algorithm)


# ---- beside the in-memory host tier (--enable-hierarchical-cache) --------------------------

POOL = {"max_total_tokens": 640, "page_size": 16}  # 40 pages
TIER = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
HISTORY = prompt_ids(1, 160)  # 10 pages
RESUME = HISTORY + prompt_ids(7, 16)


def test_an_adapters_pages_come_back_from_the_tier_to_it_alone(lora_models):
    base_folder, folders = lora_models
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    with make_engine(str(base_folder), lora_paths=paths, **POOL) as plain:
        expected = {name: plain.generate(input_ids=RESUME, lora_path=name,
                                         sampling_params=greedy(NUM_NEW))["output_ids"]
                    for name in NAMES}  # fmt: skip
    with make_engine(str(base_folder), lora_paths=paths, **POOL, **TIER) as engine:
        engine.generate(input_ids=HISTORY, lora_path="a1", sampling_params=greedy(1))
        for i in range(12):  # base prompts flood the pool: a1's pages go to the tier
            engine.generate(input_ids=prompt_ids(100 + i, 96), sampling_params=greedy(8))
        other = engine.generate(input_ids=RESUME, lora_path="a2", sampling_params=greedy(NUM_NEW))
        resumed = engine.generate(input_ids=RESUME, lora_path="a1",
                                  sampling_params=greedy(NUM_NEW))  # fmt: skip
        engine.check_integrity()
    assert other["meta_info"]["cached_tokens"] == 0 and other["output_ids"] == expected["a2"]
    assert resumed["meta_info"]["cached_tokens_details"]["host"] > 0
    assert resumed["output_ids"] == expected["a1"]


def test_a_tier_on_disk_is_refused_with_lora(lora_models, tmp_path):
    base_folder, folders = lora_models
    with pytest.raises(ValueError, match="--enable-lora does not work with --hicache-dir"):
        make_engine(str(base_folder), lora_paths=[f"a1={folders['a1']}"],
                    hicache_dir=str(tmp_path), **TIER)  # fmt: skip
