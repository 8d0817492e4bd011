"""LoRA with speculative decoding: NGRAM's and SUFFIX's drafts are verified by each adapter's
own forward, so a mixed batch still gives PEFT's tokens; SUFFIX drafts an adapter's requests
only from that adapter's outputs; model-based drafters are refused at start."""

from __future__ import annotations

import pytest
from lora_data import NUM_NEW, build_lora_models, peft_references

from conftest import greedy, make_engine
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
