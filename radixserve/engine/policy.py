"""Orders the waiting queue: lpm, dfs-weight or fcfs, with aging against starvation.

With the hierarchical cache a match has a pool part (`num_tokens`) and a tier part
(`host_tokens`, loaded back before the request runs). A tier token saves its recompute but
costs a copy, so it counts `tier_weight` = 1 - load cost / recompute cost of a pool token:

    score = num_tokens + tier_weight * host_tokens        (lpm: higher first)

and dfs-weight places the request at its deepest tier node instead of its pool node. Measured
load / recompute: ~0.02 (CPU, SmolLM2 fp32: 75 ms vs 3.7 s per 1k tokens); the simulator's
cost model, 0.006. `tier_weight` 0 orders by pool hits only: the default of
--schedule-tier-match-weight, as 0.9 did not win across workloads (docs/performance.md).

Aging counts queue positions, not steps: each time a request is admitted, every request still
waiting that arrived before it has been bypassed once. A request bypassed `max_bypass` times is
starved and goes first, oldest first, whatever the policy; so under `lpm` a cold request waits
behind at most `max_bypass` newer ones even while hot requests keep arriving (SGLang's lpm
starves it: their issue #31954), and under sustained load, when every request waits many
steps, lpm still orders by cached prefix (a bound on steps turned it into fcfs).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import defaultdict
from collections.abc import Callable, Iterable

from radixserve.cache.prefix_cache import MatchResult
from radixserve.engine.request import Req, ReqState

POLICIES = ("lpm", "dfs-weight", "fcfs")


def order_waiting(
    waiting: list[Req],
    policy: str,
    matches: dict[Req, MatchResult],
    max_bypass: int,
    parent_of: Callable[[object], object | None],
    by_priority: bool = False,
    tier_weight: float = 0.0,
) -> list[Req]:
    """Starved requests first (oldest first), then the rest in the policy's order;
    `by_priority`: the rest by priority first (higher first), the policy's order among equals.
    Aging still applies, so a low-priority request waits behind at most `max_bypass`.
    `tier_weight`: what a tier-only cached token counts for (module docstring)."""
    starved = sorted((r for r in waiting if r.num_bypassed >= max_bypass), key=_age_key)
    rest = [r for r in waiting if r.num_bypassed < max_bypass]
    if policy == "lpm":
        rest.sort(key=lambda r: (-match_score(matches[r], tier_weight), r.arrival_time))
    elif policy == "dfs-weight":
        rest = _dfs_weight_order(rest, matches, parent_of, tier_weight > 0)
    else:
        rest.sort(key=_age_key)
    if by_priority:
        rest.sort(key=lambda r: -r.priority)  # stable: the policy's order within a priority
    return starved + rest


class Aging:
    """Counts the bypasses of one step's admissions, as they happen.

    `admit` reports the requests that an admission made starved, so that the caller lets them
    go next (the bound holds within a step too); `commit` writes the counts back at its end.
    """

    def __init__(self, waiting: Iterable[Req], max_bypass: int):
        self.max_bypass = max_bypass
        self._admitted: list[float] = []  # arrival times of this step's admissions, sorted
        self._starved: set[Req] = set()
        # most bypassed first: only a prefix of them can starve within k admissions
        hungry = (r for r in waiting if r.num_bypassed < max_bypass)
        self._closest = sorted(hungry, key=lambda r: r.num_bypassed, reverse=True)

    def num_bypassed(self, req: Req) -> int:
        younger = len(self._admitted) - bisect_right(self._admitted, req.arrival_time)
        return req.num_bypassed + younger

    def admit(self, req: Req) -> list[Req]:
        """Records an admission; returns the waiting requests it made starved, oldest first."""
        insort(self._admitted, req.arrival_time)
        starved = []
        for other in self._closest:
            if other.num_bypassed + len(self._admitted) < self.max_bypass:
                break
            if other.state is ReqState.WAITING and other not in self._starved:
                if self.num_bypassed(other) >= self.max_bypass:
                    self._starved.add(other)
                    starved.append(other)
        return sorted(starved, key=_age_key)

    def commit(self, waiting: Iterable[Req]) -> None:
        if self._admitted:
            for req in waiting:
                req.num_bypassed = self.num_bypassed(req)


def match_score(match: MatchResult, tier_weight: float) -> float:
    """lpm's score of a match: pool tokens, plus tier tokens at `tier_weight`."""
    return match.num_tokens + tier_weight * match.host_tokens


def _age_key(req: Req) -> float:
    return req.arrival_time


def _dfs_weight_order(
    reqs: list[Req],
    matches: dict[Req, MatchResult],
    parent_of: Callable[[object], object | None],
    into_tier: bool = False,
) -> list[Req]:
    """SGLang paper's DFS over the radix tree: at each node, heavier subtrees (more waiting
    requests) first, so requests sharing the most cached prefix run together. `into_tier`:
    a request sits at the deepest node of its match, tier part included."""
    children: dict[int, list[object]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    at_node: dict[int, list[Req]] = defaultdict(list)
    roots: list[object] = []
    seen: set[int] = set()
    for req in sorted(reqs, key=_age_key):
        match = matches[req]
        node = match.host_node if into_tier and match.host_node is not None else match.node
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
