"""The soak's request mix: which requests benchmarks/soak.py sends, seeded and reproducible.

Kinds: native /generate (streamed or not), OpenAI completions and chat (streamed or not),
streams the client hangs up on after the first chunk (`hang_up`), streams aborted through
/abort_request by rid (`abort_request`). On top: constrained output, n > 1, logprobs,
prompts that share a prefix, long prompts, bursts of long outputs, and fault rids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

FAULT_PREFIX = "fault-"
KIND_WEIGHTS = {
    "generate": 4,
    "generate_stream": 3,
    "completion": 2,
    "completion_stream": 2,
    "chat": 2,
    "chat_stream": 2,
    "hang_up": 1,
    "abort_request": 1,
}
NATIVE_KINDS = ("generate", "generate_stream", "hang_up", "abort_request")
CUT_SHORT_KINDS = ("hang_up", "abort_request")
SHAPE_WEIGHTS = {"shared": 5, "long": 2, "short": 3}
"""Prompt shapes: one of four 96-token prefixes + a question (radix cache hits), 300-600
tokens (eviction), a few tokens."""
NUM_PREFIXES, PREFIX_TOKENS = 4, 96
RUNNING_MAX_TOKENS = 256  # the streams cut short are still running when cut
LONG_OUTPUT_TOKENS, BURST_EVERY, BURST_SIZE = 160, 100, 8
"""Of every BURST_EVERY requests, BURST_SIZE in a row generate LONG_OUTPUT_TOKENS: admitted
on an estimate of a fraction of that, together they outgrow the pool and force retractions."""
CONSTRAINED_FRACTION, LOGPROBS_FRACTION, N2_FRACTION = 0.15, 0.2, 0.15
WORDS = "the a of river stone light quiet market seven north window paper garden".split()
REGEX = "[a-z]{1,8}( [a-z]{1,8}){0,3}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass
class Plan:
    """One request to send: its kind, path, body, choices expected and what it exercises."""

    index: int
    kind: str
    path: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    num_choices: int = 1
    fault: bool = False  # carries a fault- rid: must end in an abort
    features: list[str] = field(default_factory=list)


def plan_requests(num_requests: int, seed: int = 0, fault_fraction: float = 0.0) -> list[Plan]:
    """`num_requests` plans; `fault_fraction` of the plain native ones carry a fault- rid."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KIND_WEIGHTS), list(KIND_WEIGHTS.values()), k=num_requests)
    return [make_plan(rng, Plan(i, kind), fault_fraction) for i, kind in enumerate(kinds)]


def make_plan(rng: random.Random, plan: Plan, fault_fraction: float) -> Plan:
    cut_short = plan.kind in CUT_SHORT_KINDS
    shapes = ["shared", "short"] if cut_short else list(SHAPE_WEIGHTS)
    shape = rng.choices(shapes, [SHAPE_WEIGHTS[s] for s in shapes])[0]
    plan.features.append(shape)
    plan.num_choices = 2 if not cut_short and rng.random() < N2_FRACTION else 1
    if plan.num_choices > 1:
        plan.features.append("n>1")
    max_tokens = rng.choice([4, 8, 16] if shape == "long" else [4, 8, 16, 32])
    if cut_short:
        max_tokens = RUNNING_MAX_TOKENS
    elif plan.index % BURST_EVERY >= BURST_EVERY - BURST_SIZE:
        max_tokens = LONG_OUTPUT_TOKENS
        plan.features.append("long output")
    if plan.kind in NATIVE_KINDS:
        _native(rng, plan, shape, max_tokens, fault_fraction)
    else:
        _openai(rng, plan, shape, max_tokens)
    return plan


def _native(rng, plan: Plan, shape: str, max_tokens: int, fault_fraction: float) -> None:
    ids = prompt_ids(rng, shape)
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "n": plan.num_choices}
    params |= {"temperature": 0.8, "ignore_eos": max_tokens >= LONG_OUTPUT_TOKENS}
    if rng.random() < CONSTRAINED_FRACTION:
        kind = rng.choice(["regex", "json_schema"])
        params[kind] = REGEX if kind == "regex" else SCHEMA
        plan.features.append(kind)
    plan.path = "/generate"
    plan.body = {"input_ids": ids, "sampling_params": params, "stream": plan.kind != "generate"}
    if rng.random() < LOGPROBS_FRACTION:
        plan.body |= {"return_logprob": True, "top_logprobs_num": rng.randint(0, 5)}
        if shape == "short":  # input logprobs too, for a few positions
            plan.body["logprob_start_len"] = max(len(ids) - 4, 0)
        plan.features.append("logprobs")
    plain = plan.kind in ("generate", "generate_stream")
    plan.fault = plain and rng.random() < fault_fraction
    plan.body["rid"] = f"{FAULT_PREFIX if plan.fault else 'soak-'}{plan.index}"
    if plan.fault:
        plan.features.append("fault")


def _openai(rng, plan: Plan, shape: str, max_tokens: int) -> None:
    chat = plan.kind.startswith("chat")
    body: dict[str, Any] = {"max_tokens": max_tokens, "n": plan.num_choices, "temperature": 0.8}
    body |= {"stream": plan.kind.endswith("stream"), "ignore_eos": max_tokens >= LONG_OUTPUT_TOKENS}
    if chat:
        system = prompt_text(rng, "shared" if shape == "shared" else "short")
        user = prompt_text(rng, "long" if shape == "long" else "short")
        body["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
    else:
        body["prompt"] = prompt_ids(rng, shape) if shape == "long" else prompt_text(rng, shape)
    if rng.random() < CONSTRAINED_FRACTION:
        body |= {"response_format": {"type": "json_object"}} if chat else {"regex": REGEX}
        plan.features.append("constrained")
    if rng.random() < LOGPROBS_FRACTION:
        count = rng.randint(0, 5)
        body |= {"logprobs": True, "top_logprobs": count} if chat else {"logprobs": count}
        plan.features.append("logprobs")
    plan.path = "/v1/chat/completions" if chat else "/v1/completions"
    plan.body = body


def prompt_ids(rng: random.Random, shape: str) -> list[int]:
    question = [rng.randrange(200, 5000) for _ in range(rng.randint(4, 12))]
    if shape == "shared":
        group = rng.randrange(NUM_PREFIXES)
        return [(group * 7919 + j * 31) % 4800 + 200 for j in range(PREFIX_TOKENS)] + question
    if shape == "long":
        return [rng.randrange(200, 5000) for _ in range(rng.randint(300, 600))]
    return question


def prompt_text(rng: random.Random, shape: str) -> str:
    if shape == "shared":
        group = random.Random(rng.randrange(NUM_PREFIXES))
        prefix = " ".join(group.choice(WORDS) for _ in range(80))
        return f"{prefix}. Question {rng.randrange(1000)}:"
    length = rng.randint(300, 500) if shape == "long" else rng.randint(3, 12)
    return " ".join(rng.choice(WORDS) for _ in range(length))
