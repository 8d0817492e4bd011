"""Multi-turn chat: a scripted conversation whose history lives in the program state.

Each turn appends a user message and generates the assistant's reply onto the same state,
so the prompt of turn k is the whole conversation so far. The radix cache kept turns 1..k-1
(prompt and generated reply), so from turn 2 on most of each prompt is a cache hit: the
per-turn `cached/prompt` column shows it.

Run:  .venv/bin/python examples/agents/multi_turn_chat.py [--url URL] [--max-tokens N] [--num N]
"""

from __future__ import annotations

from _common import CacheMeter, cached, open_backend, parse_args

import radixserve as sgl
from radixserve.frontend_lang import ProgramState

SYSTEM_PROMPT = "You are a friendly travel assistant. Keep every answer to one or two sentences."
USER_MESSAGES = [
    "Hi! I am planning a weekend trip to Paris.",
    "What is one museum I should visit there?",
    "And where could I eat a good croissant nearby?",
    "Thanks. How do I get from the airport to the city centre?",
    "Summarise my plan in one sentence, please.",
]


@sgl.function
def chat(s: ProgramState, messages: list[str]) -> None:
    """One user turn and one generated reply per message; the state is the history."""
    s += sgl.system(SYSTEM_PROMPT)
    for i, message in enumerate(messages):
        s += sgl.user(message)
        s += sgl.assistant(sgl.gen(f"reply_{i}"))


def print_turns(state: ProgramState, messages: list[str]) -> None:
    for i, message in enumerate(messages):
        print(f"turn {i + 1}  (cached/prompt tokens {cached(state, f'reply_{i}')})")
        print(f"  user:      {message}")
        print(f"  assistant: {state[f'reply_{i}'].strip()}")


def main() -> None:
    args = parse_args(
        __doc__, max_tokens=48, num=4, num_help=f"user turns, at most {len(USER_MESSAGES)}"
    )
    messages = USER_MESSAGES[: args.num]
    with open_backend(args.url) as backend:
        meter = CacheMeter(backend)
        state = chat.run(messages, max_new_tokens=args.max_tokens, temperature=0)
        print_turns(state, messages)
        print(meter.report())


if __name__ == "__main__":
    main()
