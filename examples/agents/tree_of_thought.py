"""Tree of thought: fork into candidate steps, let the model rate each, expand the best.

At every level the state forks into `--num` branches that share the conversation so far
(its prefix is prefilled once and every branch hits it). Each branch samples one next step
(`gen` at a temperature, so the branches differ) and rates it with `select` over the scale
1..5; the branch score is the expected rating under the model's distribution over that
scale, which breaks the ties a plain argmax would leave. The best step is appended to the
main state and the next level forks from there; a final `gen` writes the answer.

Run:  .venv/bin/python examples/agents/tree_of_thought.py [--url URL] [--max-tokens N] [--num N]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from _common import CacheMeter, cached, open_backend, parse_args

import radixserve as sgl
from radixserve.frontend_lang import ProgramState, ProgramStateGroup

DEPTH = 2
BRANCH_TEMPERATURE = 0.8
RATINGS = ["1", "2", "3", "4", "5"]

SYSTEM_PROMPT = "You are a careful planner. You think one short step at a time."
PROBLEM = "Plan a rainy Saturday afternoon for a family with two young children in a small town."
FIRST_STEP_PROMPT = "Give only the first step of the plan, in one sentence."
NEXT_STEP_PROMPT = "Good. Give only the next step of the plan, in one sentence."
RATE_PROMPT = "Rate that step from 1 (useless) to 5 (excellent). Answer with one digit."
ANSWER_PROMPT = "Now write the whole plan in two or three sentences."


@dataclass(frozen=True)
class Branch:
    """One candidate step, how the model rated it, and how much of its prompt was cached."""

    step: str
    rating: str
    score: float
    cached: str


def expected_rating(logprobs: list[float]) -> float:
    """The mean of 1..5 under the softmax of each rating's logprob."""
    weights = [math.exp(lp - max(logprobs)) for lp in logprobs]
    return sum(int(r) * w for r, w in zip(RATINGS, weights)) / sum(weights)


def propose_and_rate(branches: ProgramStateGroup) -> None:
    """Every branch samples a step, then rates it."""
    branches += sgl.assistant(sgl.gen("step", temperature=BRANCH_TEMPERATURE, stop="\n"))
    branches += sgl.user(RATE_PROMPT)
    branches += sgl.assistant(sgl.select("rating", RATINGS))


def read_branch(state: ProgramState) -> Branch:
    scores = state.get_meta_info("rating")["normalized_prompt_logprobs"]
    return Branch(state["step"], state["rating"], expected_rating(scores), cached(state, "step"))


@sgl.function
def tree_of_thought(
    s: ProgramState, problem: str, num_branches: int, depth: int = DEPTH
) -> list[list[Branch]]:
    """`depth` levels of fork / rate / keep the best; returns every level's branches."""
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(f"{problem} {FIRST_STEP_PROMPT}")
    levels: list[list[Branch]] = []
    for level in range(depth):
        if level:
            s += sgl.user(NEXT_STEP_PROMPT)
        branches = s.fork(num_branches)
        propose_and_rate(branches)
        levels.append([read_branch(branch) for branch in branches])
        branches.join()
        s += sgl.assistant(max(levels[-1], key=lambda b: b.score).step)
    s += sgl.user(ANSWER_PROMPT)
    s += sgl.assistant(sgl.gen("answer"))
    return levels


def print_tree(state: ProgramState) -> None:
    print(f"problem: {PROBLEM}")
    for level, branches in enumerate(state.ret_value):
        best = max(branches, key=lambda b: b.score)
        print(f"level {level + 1}:")
        for branch in branches:
            mark = "*" if branch is best else " "
            print(f" {mark} [rated {branch.rating}, score {branch.score:.2f}, "
                  f"cached/prompt {branch.cached}] {branch.step.strip()}")  # fmt: skip
    print(f"answer (cached/prompt {cached(state, 'answer')}): {state['answer'].strip()}")


def main() -> None:
    args = parse_args(__doc__, max_tokens=40, num=3, num_help="branches per level")
    with open_backend(args.url) as backend:
        meter = CacheMeter(backend)
        state = tree_of_thought.run(
            PROBLEM, args.num, max_new_tokens=args.max_tokens, temperature=0
        )
        print_tree(state)
        print(meter.report())


if __name__ == "__main__":
    main()
