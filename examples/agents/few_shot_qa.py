"""Few-shot QA: `run_batch` answers many questions behind one shared few-shot prefix.

Every program writes the same system prompt and worked examples before its question, so
`run_batch` finds that constant prefix by tracing, prefills it once, and then runs all the
programs concurrently; each question's prompt is then mostly a cache hit.

Run:  .venv/bin/python examples/agents/few_shot_qa.py [--url URL] [--max-tokens N] [--num N]
"""

from __future__ import annotations

from _common import CacheMeter, cached, open_backend, parse_args

import radixserve as sgl
from radixserve.frontend_lang import ProgramState

SYSTEM_PROMPT = "You answer general-knowledge questions with a single word or number."
EXAMPLES = [
    ("What color is the sky on a clear day?", "Blue"),
    ("What is frozen water called?", "Ice"),
    ("What do bees make?", "Honey"),
    ("How many legs does a spider have?", "8"),
    ("What is the capital of Italy?", "Rome"),
]
QUESTIONS = [
    "What is the opposite of hot?",
    "What animal says meow?",
    "What is 2 plus 2?",
    "What is the capital of France?",
    "What planet do we live on?",
    "How many days are in a week?",
    "What gas do plants breathe in?",
    "What is the largest ocean on Earth?",
    "What color are bananas when ripe?",
    "How many wheels does a bicycle have?",
    "What language is spoken in Spain?",
    "What do cows drink?",
]


@sgl.function
def few_shot_qa(s: ProgramState, question: str) -> None:
    """The few-shot turns (identical in every program), then this question's answer."""
    s += sgl.system(SYSTEM_PROMPT)
    for example_question, example_answer in EXAMPLES:
        s += sgl.user(example_question)
        s += sgl.assistant(example_answer)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", stop="\n"))


def main() -> None:
    args = parse_args(__doc__, max_tokens=12, num=len(QUESTIONS), num_help="questions")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num)]
    with open_backend(args.url) as backend:
        meter = CacheMeter(backend)
        states = few_shot_qa.run_batch(
            [{"question": q} for q in questions], max_new_tokens=args.max_tokens, temperature=0
        )
        for question, state in zip(questions, states):
            print(
                f"[cached/prompt {cached(state, 'answer')}] {question} -> {state['answer'].strip()}"
            )
        print(meter.report())


if __name__ == "__main__":
    main()
