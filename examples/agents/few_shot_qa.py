"""Few-shot QA: one shared few-shot prefix, several questions answered in one batch.

Run: .venv/bin/python examples/agents/few_shot_qa.py
The few-shot prefix is computed once; every other question hits it in the radix cache
(the engine's counters, printed last, show it).
"""

from __future__ import annotations

from radixserve import Engine

FEW_SHOT = (
    "Answer with one word.\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n"
    "Q: What is frozen water called?\nA: Ice\n"
    "Q: What do bees make?\nA: Honey\n"
)
QUESTIONS = ["What is the opposite of hot?", "What animal says meow?", "What is 2 plus 2?"]


def main() -> None:
    with Engine(max_total_tokens=4096) as engine:
        prompts = [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS]
        params = {"temperature": 0, "max_new_tokens": 8, "stop": "\n"}
        for question, out in zip(QUESTIONS, engine.generate(prompts, params)):
            cached = out["meta_info"]["cached_tokens"]
            print(f"{question} -> {out['text'].strip()}   (cached prompt tokens: {cached})")
        stats = engine.get_stats()
        computed = stats["prefill_tokens_computed"]
        print(f"prompt tokens {stats['prompt_tokens']}, prefill tokens computed {computed}")


if __name__ == "__main__":
    main()
