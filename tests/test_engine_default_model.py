"""The Engine on the default model (SmolLM2-135M-Instruct): cache equivalence, multi-turn."""

from __future__ import annotations

import pytest

from radixserve import Engine

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a concise assistant for a hardware store. Answer in one short sentence. "
    "Our store opens at 8am and closes at 6pm, sells tools, paint, garden supplies and "
    "lumber, and offers key cutting and free delivery for orders over fifty dollars."
)
QUESTIONS = ["When do you open?", "Do you cut keys?", "Is delivery free?", "Do you sell paint?"]
GREEDY = {"temperature": 0, "max_new_tokens": 16}


# Cold, warm and uncached runs compute a prompt's attention in different kernels (fresh
# prefill, extend over cached pages, batched decode); bitwise-equal outputs are what
# --enable-deterministic-inference promises, so that is what runs here.
DETERMINISTIC = {"max_total_tokens": 8192, "enable_deterministic_inference": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(**DETERMINISTIC) as e:
        yield e


def chat(engine, messages) -> str:
    return engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def prompts(engine) -> list[str]:
    return [
        chat(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]


def test_cold_warm_and_uncached_outputs_are_identical(engine):
    texts = prompts(engine)
    assert engine.flush_cache()
    cold = [engine.generate(t, GREEDY) for t in texts]  # one by one: 2nd..4th hit the system prompt
    warm = engine.generate(texts, GREEDY)
    with Engine(**DETERMINISTIC, disable_radix_cache=True) as plain:
        uncached = plain.generate(texts, GREEDY)
    ids = [engine.tokenizer.encode(t) for t in texts]
    shared = len(_common_prefix(ids)) // 16 * 16
    for i, (c, w, u) in enumerate(zip(cold, warm, uncached)):
        assert c["output_ids"] == w["output_ids"] == u["output_ids"]
        assert c["meta_info"]["cached_tokens"] == (0 if i == 0 else shared)
        assert w["meta_info"]["cached_tokens"] == (len(ids[i]) - 1) // 16 * 16
        assert u["meta_info"]["cached_tokens"] == 0
    assert all(c["text"].strip() for c in cold)


def test_second_turn_hits_the_first_turn_and_its_answer(engine):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    first_prompt = chat(engine, history)
    first = engine.generate(first_prompt, GREEDY)
    history += [
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "And when do you close?"},
    ]
    second = engine.generate(chat(engine, history), GREEDY)
    turn1_len = first["meta_info"]["prompt_tokens"] + first["meta_info"]["completion_tokens"]
    # the template closes the answer with <|im_end|>, which the model emitted as its EOS
    assert second["meta_info"]["cached_tokens"] >= (turn1_len - 1) // 16 * 16
    engine.check_integrity()


def _common_prefix(lists: list[list[int]]) -> list[int]:
    out = []
    for column in zip(*lists):
        if len(set(column)) > 1:
            break
        out.append(column[0])
    return out
