"""ReAct agent: thought / action / observation rounds with real Python tools.

The model reasons in text (`gen`), picks its next action from a fixed list (`select`, so it
can only name a real tool), writes the tool's input (`gen` with `stop`), and the program
runs the tool and appends what it returned. Every question starts with the same system
prompt holding the tool definitions, so `run_batch` prefills it once for all questions,
and each round's prompt is the previous round's prompt plus a few lines: a cache hit.

Tools: `calculator` evaluates arithmetic by walking its `ast` (no eval); `search` looks
words up in a handful of documents defined below.

Run:  .venv/bin/python examples/agents/react_tools.py [--url URL] [--max-tokens N] [--num N]
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from _common import CacheMeter, cached, open_backend, parse_args

import radixserve as sgl
from radixserve.frontend_lang import ProgramState

MAX_ROUNDS = 4
MAX_OBSERVATION_CHARS = 200

# ---- tools -------------------------------------------------------------------------------

BINARY_OPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY_OPS: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); of
    `a = b` (small models like to write the answer too), the value of `a`."""
    text = expression.split("=")[0].strip().strip("`").replace("^", "**").replace(",", "")
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError) as exc:
        return f"error: {exc}"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = BINARY_OPS[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError(f"{ast.unparse(node)!r} is not a real number")
        return value
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


DOCUMENTS = {
    "Eiffel Tower": "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Python": "Python is a programming language created by Guido van Rossum, first released "
    "in 1991.",
    "Mount Everest": "Mount Everest is the highest mountain on Earth, 8849 metres above sea "
    "level, on the border of Nepal and China.",
    "Moon": "The Moon orbits the Earth at an average distance of 384400 kilometres.",
    "Radix tree": "A radix tree stores strings by their shared prefixes; radixserve uses one "
    "to reuse the KV cache of prompts that start the same way.",
}


def search(query: str) -> str:
    """The document sharing the most words with `query`, as `title: text`."""
    words = _words(query)
    scores = {title: len(words & _words(title + " " + text)) for title, text in DOCUMENTS.items()}
    best = max(scores, key=scores.__getitem__)
    return f"{best}: {DOCUMENTS[best]}" if scores[best] else "no document matches"


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "search": search}
FINISH = "finish"
ACTIONS = [*TOOLS, FINISH]

# ---- the agent ---------------------------------------------------------------------------

SYSTEM_PROMPT = """You answer questions by using tools, one step at a time. Never guess a fact
or do arithmetic yourself: search for facts and use the calculator for arithmetic.
Tools:
- calculator: evaluates an arithmetic expression, for example 12 * (3 + 4)
- search: finds a short document about a topic, for example Eiffel Tower
- finish: ends the task; its input is the final answer
Each step has this form:
Thought: what you need to do next
Action: calculator, search or finish
Action Input: the input of the action
Observation: what the tool returned

Example question: How many metres higher is Mount Everest than 8000 metres?
Thought: I need the height of Mount Everest.
Action: search
Action Input: Mount Everest height
Observation: Mount Everest: Mount Everest is the highest mountain on Earth, 8849 metres above \
sea level, on the border of Nepal and China.
Thought: I need to subtract 8000 from 8849.
Action: calculator
Action Input: 8849 - 8000
Observation: 849
Thought: I know the answer.
Action: finish
Action Input: 849 metres"""

QUESTIONS = [
    "How many feet tall is the Eiffel Tower? One metre is 3.28 feet.",
    "What is 17 * 23 + 4?",
    "In which year was Python first released, and how many years ago was that from 2025?",
]


@dataclass(frozen=True)
class Step:
    """One round: what the model thought and did, and what the tool answered."""

    thought: str
    action: str
    action_input: str
    observation: str | None  # None for `finish`


def run_tool(action: str, action_input: str) -> str:
    return TOOLS[action](action_input)[:MAX_OBSERVATION_CHARS]


@sgl.function
def react(s: ProgramState, question: str, max_rounds: int = MAX_ROUNDS) -> list[Step]:
    """Thought, action (selected), input (generated), observation; until `finish`."""
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(question)
    steps: list[Step] = []
    with s.assistant():
        for i in range(max_rounds):
            s += "Thought:" + sgl.gen(f"thought_{i}", stop=["\n", "Action:"]) + "\n"
            s += "Action: " + sgl.select(f"action_{i}", ACTIONS) + "\n"
            s += "Action Input:" + sgl.gen(f"input_{i}", stop="\n")
            action, action_input = s[f"action_{i}"], s[f"input_{i}"].strip()
            observation = None if action == FINISH else run_tool(action, action_input)
            steps.append(Step(s[f"thought_{i}"].strip(), action, action_input, observation))
            if observation is None:
                break
            s += f"\nObservation: {observation}\n"
    return steps


def print_trajectory(question: str, state: ProgramState) -> None:
    print(f"Q: {question}")
    for i, step in enumerate(state.ret_value):
        print(f"  round {i + 1} (cached/prompt {cached(state, f'thought_{i}')})")
        print(f"    thought: {step.thought}")
        print(f"    action:  {step.action}({step.action_input!r})")
        if step.observation is not None:
            print(f"    observation: {step.observation}")
    last = state.ret_value[-1]
    answer = last.action_input if last.action == FINISH else f"(no answer in {MAX_ROUNDS} rounds)"
    print(f"  answer: {answer}")


def main() -> None:
    args = parse_args(__doc__, max_tokens=32, num=len(QUESTIONS), num_help="questions")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num)]
    with open_backend(args.url) as backend:
        meter = CacheMeter(backend)
        states = react.run_batch(
            [{"question": q} for q in questions], max_new_tokens=args.max_tokens, temperature=0
        )
        for question, state in zip(questions, states):
            print_trajectory(question, state)
        print(meter.report())


if __name__ == "__main__":
    main()
