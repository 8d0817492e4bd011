"""Orders the waiting queue: lpm, dfs-weight or fcfs, with aging against starvation.

Any request that has waited `max_wait_steps` steps goes first, oldest first, whatever the
policy; so under `lpm` a cold request is delayed a bounded number of steps even while hot
requests keep arriving (SGLang's lpm starves it: their issue #31954).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from radixserve.cache.prefix_cache import MatchResult
from radixserve.engine.request import Req

POLICIES = ("lpm", "dfs-weight", "fcfs")


def order_waiting(
    waiting: list[Req],
    policy: str,
    matches: dict[Req, MatchResult],
    max_wait_steps: int,
    parent_of: Callable[[object], object | None],
) -> list[Req]:
    """Starved requests first (oldest first), then the rest in the policy's order."""
    starved = sorted((r for r in waiting if r.wait_steps >= max_wait_steps), key=_age_key)
    rest = [r for r in waiting if r.wait_steps < max_wait_steps]
    if policy == "lpm":
        rest.sort(key=lambda r: (-matches[r].num_tokens, r.arrival_time))
    elif policy == "dfs-weight":
        rest = _dfs_weight_order(rest, matches, parent_of)
    else:
        rest.sort(key=_age_key)
    return starved + rest


def _age_key(req: Req) -> float:
    return req.arrival_time


def _dfs_weight_order(
    reqs: list[Req], matches: dict[Req, MatchResult], parent_of: Callable[[object], object | None]
) -> list[Req]:
    """SGLang paper's DFS over the radix tree: at each node, heavier subtrees (more waiting
    requests) first, so requests sharing the most cached prefix run together."""
    children: dict[int, list[object]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    at_node: dict[int, list[Req]] = defaultdict(list)
    roots: list[object] = []
    seen: set[int] = set()
    for req in sorted(reqs, key=_age_key):
        node = matches[req].node
        at_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            parent = parent_of(node)
            if id(node) not in seen:
                seen.add(id(node))
                (roots if parent is None else children[id(parent)]).append(node)
            node = parent
    ordered: list[Req] = []
    stack = sorted(roots, key=lambda n: weight[id(n)])
    while stack:
        node = stack.pop()
        ordered.extend(at_node[id(node)])
        stack.extend(sorted(children[id(node)], key=lambda n: weight[id(n)]))
    return ordered
