"""Few-shot QA: one shared few-shot prefix, several questions answered in one batch.

Run: .venv/bin/python examples/agents/few_shot_qa.py
Today this drives the model runner directly; once the radix cache lands, the shared
few-shot prefix is computed once and every question hits it.
"""

from __future__ import annotations

from radixserve.config import CacheConfig, LoadConfig
from radixserve.engine.greedy import greedy_generate
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer

FEW_SHOT = (
    "Answer with one word.\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n"
    "Q: What is frozen water called?\nA: Ice\n"
)
QUESTIONS = ["What is the opposite of hot?", "What animal says meow?", "What is 2 plus 2?"]


def main() -> None:
    load_config = LoadConfig()
    loaded = load_model(load_config)
    runner = ModelRunner.from_loaded(loaded, load_config, CacheConfig(max_total_tokens=4096))
    tokenizer = load_tokenizer(loaded)
    prompts = [tokenizer.encode(f"{FEW_SHOT}Q: {q}\nA:") for q in QUESTIONS]
    newline = tokenizer.encode("\n")
    outputs = greedy_generate(runner, prompts, max_new_tokens=8, stop_token_ids=newline)
    for question, out in zip(QUESTIONS, outputs):
        print(f"{question} -> {tokenizer.decode(out, skip_special_tokens=True).strip()}")


if __name__ == "__main__":
    main()
