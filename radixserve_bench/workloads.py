"""Seeded benchmark workloads as request graphs.

A workload is a list of requests in dispatch order. A request with a parent continues its
parent's conversation, so it can only be sent once the parent has finished:

    prompt(r) = prompt(parent) + answer(parent) + r.new_ids      (r.new_ids alone if no parent)

shared-prefix requests have no parents; multi-turn and agent requests form chains; fork
requests form trees. Runners feed the real answers; `Workload.prompts()` without answers
uses placeholder ids (negative, so they never match real tokens) for planning.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve_bench.text import TextSource


@dataclass(frozen=True)
class BenchRequest:
    """One request: appended ids, output length, and where it sits in its conversation."""

    parent: int | None
    new_ids: list[int]
    output_len: int
    conversation: int = 0
    """Group, conversation, agent or tree the request belongs to."""
    turn: int = 0
    """Depth in its conversation: 0 for a first turn or root."""
    session_id: str | None = None
    """The agent session it belongs to (retention runs send it with a TTL)."""
    delay_s: float = 0.0
    """Seconds it waits before it may go: after its parent finishes (a tool call's pause), or
    after the start without a parent. Only `bench simulate`'s clock honours it."""


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    config: dict[str, Any] = field(default_factory=dict)

    def prompt_ids(self, index: int, prompts: Sequence[list[int]], outputs: Sequence[list[int]]):
        """Request `index`'s prompt, given its parent's prompt and real answer."""
        req = self.requests[index]
        if req.parent is None:
            return list(req.new_ids)
        return prompts[req.parent] + list(outputs[req.parent]) + req.new_ids

    def prompts(self, outputs: Sequence[list[int]] | None = None) -> list[list[int]]:
        """Every prompt, from real answers or (None) from unique placeholder answers."""
        outputs = outputs if outputs is not None else placeholder_outputs(self)
        prompts: list[list[int]] = []
        for i in range(len(self.requests)):
            prompts.append(self.prompt_ids(i, prompts, outputs))
        return prompts


def placeholder_outputs(workload: Workload) -> list[list[int]]:
    """Distinct negative ids standing in for each request's answer."""
    outputs, next_id = [], -1
    for req in workload.requests:
        outputs.append(list(range(next_id, next_id - req.output_len, -1)))
        next_id -= req.output_len
    return outputs


# ---- generators ----------------------------------------------------------------------------


@dataclass
class SharedPrefixConfig:
    """SGLang's generated-shared-prefix shape: groups of prompts sharing a system prompt."""

    num_groups: int = 64
    prompts_per_group: int = 16
    system_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_groups=8, prompts_per_group=8, system_len=1024, question_len=64,
                      output_len=32),
    }  # fmt: skip


def shared_prefix(cfg: SharedPrefixConfig, text: TextSource) -> list[BenchRequest]:
    """G x P prompts = a group's system prompt + its own question, shuffled."""
    reqs = []
    for group in range(cfg.num_groups):
        system = text.tokens(cfg.system_len)
        for _ in range(cfg.prompts_per_group):
            ids = system + text.tokens(cfg.question_len)
            reqs.append(BenchRequest(None, ids, cfg.output_len, group))
    text.rng.shuffle(reqs)
    return reqs


@dataclass
class MultiTurnConfig:
    """Chat sessions: each turn resends the history and the previous answer, plus a message."""

    num_conversations: int = 64
    num_turns: int = 8
    system_len: int = 512
    user_len: int = 128
    output_len: int = 256
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_conversations=16, num_turns=4, system_len=128, user_len=64,
                      output_len=32),
    }  # fmt: skip


def multi_turn(cfg: MultiTurnConfig, text: TextSource) -> list[BenchRequest]:
    """C x T turns, turn-major so that conversations interleave; system prompt shared."""
    system = text.encode("System:") + text.tokens(cfg.system_len)
    user, assistant = text.encode("\nUser:"), text.encode("\nAssistant:")
    reqs: list[BenchRequest] = []
    for turn in range(cfg.num_turns):
        for conv in range(cfg.num_conversations):
            parent = None if turn == 0 else len(reqs) - cfg.num_conversations
            ids = (system if turn == 0 else []) + user + text.tokens(cfg.user_len) + assistant
            reqs.append(BenchRequest(parent, ids, cfg.output_len, conv, turn))
    return reqs


@dataclass
class AgentConfig:
    """ReAct-like agents: shared tool definitions, a task, then thought+action / observation."""

    num_agents: int = 32
    num_rounds: int = 8
    system_len: int = 2048
    task_len: int = 128
    observation_len: int = 256
    output_len: int = 128
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_agents=12, num_rounds=4, system_len=768, task_len=64,
                      observation_len=64, output_len=24),
    }  # fmt: skip


def agent(cfg: AgentConfig, text: TextSource) -> list[BenchRequest]:
    """A x R rounds, round-major; round r > 0 appends an observation of the last action."""
    system = text.tool_definitions(cfg.system_len)
    task, observe = text.encode("\nTask:"), text.encode("\nObservation:")
    thought = text.encode("\nThought:")
    reqs: list[BenchRequest] = []
    for rnd in range(cfg.num_rounds):
        for agent_id in range(cfg.num_agents):
            if rnd == 0:
                parent, ids = None, system + task + text.tokens(cfg.task_len) + thought
            else:
                parent = len(reqs) - cfg.num_agents
                ids = observe + text.tokens(cfg.observation_len) + thought
            reqs.append(BenchRequest(parent, ids, cfg.output_len, agent_id, rnd))
    return reqs


@dataclass
class ToolEchoConfig:
    """Agents whose answers quote their tool's output back (speculative decoding's best
    case: n-gram drafts come from the prompt): each round a JSON tool result, then the
    request to copy it; the next round continues after the copy."""

    num_agents: int = 8
    num_rounds: int = 4
    system_len: int = 512
    num_records: int = 6
    output_len: int = 160
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_agents=4, num_rounds=2, system_len=128, num_records=3, output_len=64),
    }  # fmt: skip


def tool_echo(cfg: ToolEchoConfig, text: TextSource) -> list[BenchRequest]:
    """A x R rounds, round-major; each round appends a tool result and the copy request."""
    system = text.tool_definitions(cfg.system_len)
    ask = text.encode("\nCopy the tool result above exactly, character for character:\n")
    reqs: list[BenchRequest] = []
    for rnd in range(cfg.num_rounds):
        for agent_id in range(cfg.num_agents):
            result = text.encode("\nTool result:\n" + text.json_records(cfg.num_records)) + ask
            parent = None if rnd == 0 else len(reqs) - cfg.num_agents
            ids = (system if rnd == 0 else []) + result
            reqs.append(BenchRequest(parent, ids, cfg.output_len, agent_id, rnd))
    return reqs


@dataclass
class ForkConfig:
    """Tree-of-thought: a root thought over a context, then branches that fan out from it."""

    num_trees: int = 16
    fan_out: int = 4
    depth: int = 2
    context_len: int = 2048
    branch_len: int = 64
    output_len: int = 128
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_trees=4, fan_out=3, depth=2, context_len=768, branch_len=32,
                      output_len=32),
    }  # fmt: skip


def fork(cfg: ForkConfig, text: TextSource) -> list[BenchRequest]:
    """Level-major over all trees: roots, then every root's branches, then theirs."""
    question = text.encode("\nQuestion:") + text.tokens(cfg.branch_len) + text.encode("\nIdea:")
    reqs = [
        BenchRequest(None, text.tokens(cfg.context_len) + question, cfg.output_len, tree)
        for tree in range(cfg.num_trees)
    ]
    level = list(range(cfg.num_trees))
    for depth in range(1, cfg.depth + 1):
        next_level = []
        for parent in level:
            for k in range(cfg.fan_out):
                ids = text.encode(f"\nBranch {k + 1}:") + text.tokens(cfg.branch_len)
                reqs.append(BenchRequest(parent, ids, cfg.output_len, reqs[parent].conversation,
                                         depth))  # fmt: skip
                next_level.append(len(reqs) - 1)
        level = next_level
    return reqs


@dataclass
class AgentSessionsConfig:
    """Agent sessions that pause for tool calls while one-off prompts flood the server: the
    workload where plain LRU evicts exactly the sessions about to resume."""

    num_sessions: int = 12
    num_turns: int = 4
    context_len: int = 512
    """Each session's own task context (sessions share nothing)."""
    observation_len: int = 64
    """Tool result appended to each resumed turn."""
    output_len: int = 32
    pause_ms: int = 30000
    """Mean tool-call pause between a turn's answer and the next turn (exponential)."""
    session_gap_ms: int = 4000
    """Start of session s: s times this after the start."""
    num_flood: int = 60
    """One-off prompts, arriving uniformly over the sessions' expected span."""
    flood_len: int = 256
    flood_output_len: int = 16
    PRESETS: ClassVar[dict[str, dict[str, int]]] = {
        "small": dict(num_sessions=6, num_turns=3, context_len=256, observation_len=32,
                      output_len=8, pause_ms=10000, session_gap_ms=2000, num_flood=40,
                      flood_len=256, flood_output_len=8),
    }  # fmt: skip


def agent_sessions(cfg: AgentSessionsConfig, text: TextSource) -> list[BenchRequest]:
    """S first turns, then the flood (roots with arrival delays), then the later turns
    turn-major, each a child of the session's previous turn after a drawn pause."""
    rng = text.rng
    task, observe = text.encode("\nTask:"), text.encode("\nObservation:")
    reqs = [
        BenchRequest(
            None,
            task + text.tokens(cfg.context_len),
            cfg.output_len,
            s,
            0,
            f"agent-{s}",
            s * cfg.session_gap_ms / 1000,
        )  # fmt: skip
        for s in range(cfg.num_sessions)
    ]
    span_s = (cfg.num_sessions * cfg.session_gap_ms + cfg.num_turns * cfg.pause_ms) / 1000
    for i in range(cfg.num_flood):
        flood = BenchRequest(
            parent=None,
            new_ids=text.tokens(cfg.flood_len),
            output_len=cfg.flood_output_len,
            conversation=cfg.num_sessions + i,
            delay_s=rng.uniform(0, span_s),
        )
        reqs.append(flood)
    previous = list(range(cfg.num_sessions))
    for turn in range(1, cfg.num_turns):
        for s in range(cfg.num_sessions):
            pause = rng.expovariate(1000 / cfg.pause_ms)
            ids = observe + text.tokens(cfg.observation_len)
            reqs.append(
                BenchRequest(previous[s], ids, cfg.output_len, s, turn, f"agent-{s}", pause)
            )
            previous[s] = len(reqs) - 1
    return reqs


# ---- registry ------------------------------------------------------------------------------

Generator = Callable[[Any, TextSource], list[BenchRequest]]
WORKLOADS: dict[str, tuple[type, Generator]] = {
    "shared-prefix": (SharedPrefixConfig, shared_prefix),
    "multi-turn": (MultiTurnConfig, multi_turn),
    "agent": (AgentConfig, agent),
    "tool-echo": (ToolEchoConfig, tool_echo),
    "fork": (ForkConfig, fork),
    "agent-sessions": (AgentSessionsConfig, agent_sessions),
}


def workload_config(name: str, preset: str = "default", overrides: dict | None = None):
    """The named workload's config dataclass: defaults, then a preset, then overrides."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name][0]
    if preset != "default" and preset not in cls.PRESETS:
        choices = ", ".join(["default", *cls.PRESETS])
        raise ValueError(f"unknown preset {preset!r} for {name}; choose from {choices}")
    values = cls.PRESETS.get(preset, {}) | (overrides or {})
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {name} parameter(s): {', '.join(sorted(unknown))}")
    return cls(**values)


def make_workload(
    name: str, tokenizer, seed: int = 0, preset: str = "default", overrides: dict | None = None
) -> Workload:
    """Builds a workload deterministically from `seed` with the given tokenizer."""
    cfg = workload_config(name, preset, overrides)
    requests = WORKLOADS[name][1](cfg, TextSource(tokenizer, random.Random(seed)))
    config = dataclasses.asdict(cfg) | {"preset": preset, "seed": seed}
    return Workload(name, requests, config)


def parse_overrides(spec: str | None) -> dict[str, int]:
    """`"num_groups=2,output_len=4"` -> {"num_groups": 2, "output_len": 4}."""
    if not spec:
        return {}
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"workload args must look like name=value,name=value; got {spec!r}")
    return {key.strip().replace("-", "_"): int(value) for key, value in pairs}


def default_tokenizer():
    """The default model's (SmolLM2) tokenizer, loaded offline."""
    from radixserve.model.tokenizer import open_tokenizer

    return open_tokenizer(None, 49152, "SmolLM2")


def warmup_workload(tokenizer, num_requests: int, seed: int = 0) -> Workload:
    """Short independent requests whose words share no prefix with the measured workload."""
    text = TextSource(tokenizer, random.Random(f"warmup-{seed}"))
    requests = [BenchRequest(None, text.tokens(32), 4, i) for i in range(num_requests)]
    return Workload("warmup", requests, {"num_requests": num_requests})
