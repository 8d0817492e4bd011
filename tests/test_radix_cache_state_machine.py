"""RadixCache under random request lifecycles: a hypothesis state machine matches, locks,
allocates, inserts, unlocks, pins and evicts as a scheduler would, checking every match's
pages and the page accounting after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache

# Prompts cut from a few shared stems plus a random tail, so prefixes overlap and nodes split.
STEMS = [(0, 0, 1, 1) * 3, (0, 1) * 6, (1, 0, 0, 0) * 3]
TOKENS = st.builds(
    lambda stem, cut, tail: list(stem[:cut]) + tail,
    st.sampled_from(STEMS),
    st.integers(0, 12),
    st.lists(st.integers(0, 1), max_size=6),
).filter(bool)
NAMESPACES = st.sampled_from([None, "salt"])


class CacheMachine(RuleBasedStateMachine):
    """Requests match, lock, allocate, insert, unlock and free as a scheduler would.

    `content[page]` records which (namespace, prefix) a page's KV was computed for, so every
    match can be checked to return pages holding exactly the matched prefix.
    """

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.allocator = PageAllocator(25)
        self.cache = RadixCache(self.allocator, page_size)
        self.size = page_size
        self.requests: list[dict] = []
        self.content: dict[int, tuple] = {}
        self.tree_pages: set[int] = set()
        self.pins: list[tuple] = []  # (node, pages its path held when pinned)

    def held_pages(self) -> list[int]:
        return [p for req in self.requests for p in req["own"]]

    def expected_match(self, tokens, namespace, limit) -> int:
        cached = {self.content[p] for p in self.tree_pages}
        num = 0
        while num + self.size <= limit and (namespace, tuple(tokens[: num + self.size])) in cached:
            num += self.size
        return num

    def check_match(self, tokens, namespace, result, limit) -> None:
        assert result.num_tokens == self.expected_match(tokens, namespace, limit)
        assert len(result.pages) * self.size == result.num_tokens
        for i, page in enumerate(result.pages):
            assert self.content[page] == (namespace, tuple(tokens[: (i + 1) * self.size]))

    @rule(tokens=TOKENS, namespace=NAMESPACES, max_tokens=st.none() | st.integers(0, 14))
    def match_only(self, tokens, namespace, max_tokens):
        before = self.cache.size_info()
        result = self.cache.match_prefix(tokens, namespace, max_tokens)
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        self.check_match(tokens, namespace, result, limit // self.size * self.size)
        assert self.cache.size_info() == before

    @precondition(lambda self: len(self.requests) < 4)
    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def start_request(self, tokens, namespace):
        self.start(tokens, namespace)

    @precondition(lambda self: 0 < len(self.requests) < 4)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def start_sharing_request(self, data, tail):
        """A prompt that forks off a running one: its match may end inside a locked node."""
        req = data.draw(st.sampled_from(self.requests))
        cut = data.draw(st.integers(0, len(req["tokens"])))
        if req["tokens"][:cut] + tail:
            self.start(req["tokens"][:cut] + tail, req["ns"])

    def start(self, tokens, namespace) -> None:
        match = self.cache.match_prefix(tokens, namespace)
        limit = (len(tokens) - 1) // self.size * self.size
        self.check_match(tokens, namespace, match, limit)
        self.cache.lock(match.node)
        num_new = -(-len(tokens) // self.size) - len(match.pages)
        if not self.allocator.can_allocate(num_new):
            self.evict_checked(num_new - self.allocator.num_free)
        if not self.allocator.can_allocate(num_new):
            self.cache.unlock(match.node)
            return
        own = self.allocator.allocate(num_new).tolist()
        for i, page in enumerate(own, start=len(match.pages)):
            self.content[page] = (namespace, tuple(tokens[: (i + 1) * self.size]))
        req = dict(tokens=tokens, ns=namespace, match=match, own=own, extra_locks=0)
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        tokens, match, size = req["tokens"], req["match"], self.size
        num_cached = self.cache.insert(tokens, match.pages + req["own"], req["ns"])
        assert num_cached >= match.num_tokens  # a locked prefix cannot have gone away
        first_own, num_whole = len(match.pages), len(tokens) // size
        taken = req["own"][num_cached // size - first_own : num_whole - first_own]
        self.tree_pages.update(taken)
        self.allocator.free([p for p in req["own"] if p not in taken])
        for _ in range(req["extra_locks"] + 1):
            self.cache.unlock(match.node)
        again = self.cache.match_prefix(tokens, req["ns"], max_tokens=len(tokens))
        assert again.num_tokens == num_whole * size

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def lock_again(self, data):
        req = data.draw(st.sampled_from(self.requests))
        self.cache.lock(req["match"].node)
        req["extra_locks"] += 1

    @precondition(lambda self: any(req["extra_locks"] for req in self.requests))
    @rule(data=st.data())
    def unlock_extra(self, data):
        req = data.draw(st.sampled_from([r for r in self.requests if r["extra_locks"]]))
        self.cache.unlock(req["match"].node)
        req["extra_locks"] -= 1

    @precondition(lambda self: self.tree_pages and len(self.pins) < 3)
    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def pin(self, tokens, namespace):
        match = self.cache.match_prefix(tokens, namespace, max_tokens=len(tokens))
        if match.num_tokens:
            self.cache.pin(match.node)
            self.pins.append((match.node, list(match.pages)))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        node, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.unpin(node)

    @rule(num_pages=st.integers(0, 30))
    def evict(self, num_pages):
        self.evict_checked(num_pages)

    def evict_checked(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable_pages()
        num_freed = self.cache.evict(num_pages)
        assert num_freed >= min(num_pages, evictable)
        assert self.cache.num_evictable_pages() == evictable - num_freed
        self.tree_pages -= set(self.allocator.free_pages().tolist())
        for req in self.requests:  # locked prefixes survive
            assert set(req["match"].pages) <= self.tree_pages
        for _, pages in self.pins:  # and pinned ones
            assert set(pages) <= self.tree_pages

    @invariant()
    def pages_are_accounted_for(self):
        if not hasattr(self, "cache"):
            return
        held = self.held_pages()
        self.cache.check_integrity(held)
        info = self.cache.size_info()
        assert info.total_pages == len(self.tree_pages)
        assert self.allocator.num_free + info.total_pages + len(held) == self.allocator.capacity

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.pins:
            self.cache.unpin(node)
        for req in self.requests:
            for _ in range(req["extra_locks"] + 1):
                self.cache.unlock(req["match"].node)
            self.allocator.free(req["own"])
        self.cache.reset()
        assert self.allocator.num_free == self.allocator.capacity


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_cache_state_machine = CacheMachine.TestCase
