"""ReqPages: moves KV pages between the allocator, the prefix cache and running requests.

    page_table:  [ tree pages (locked via last_node) | own pages (freed or given to the tree) ]
                   0 .. num_tree_pages                  num_tree_pages ..

A request starts with the pages its prompt matched in the tree (locked), grows own pages
as it computes, may hand computed full pages to the tree while running (so others can hit
them) and, when it finishes or is retracted, gives all its full pages to the tree and frees
the rest. `insert` reports what the tree already had: those own pages are duplicates.

Retention (cache/retention.py): admitting a request of a session ends the session's pin (the
request now locks what it reads); a request that asks for a pin gets its whole pages pinned
when it finishes. Pins give way, oldest first, only when nothing else could free a page
(pin_policy "hard"), or whenever unpinned pages run out (pin_policy "last").

Received KV (disaggregated decode, engine/kv_handoff.py): pages stored into the tree for a
request that is not admitted yet are held, a lock on their node per request, until it is
admitted (its own match then locks them) or leaves; so LRU eviction never takes them. Holds
give way, newest first, only when eviction alone cannot free the pages an allocation needs
(before any retraction, before pins), so they can never starve admission or decodes.

Sliding-window models (a HybridKVPool, cache/swa_pool.py): after each step a request frees
the sliding K/V of its own pages that end before its last `window` positions
(`free_out_of_window`), so it holds at most window / page_size + 1 sliding pages of its own
between steps; those pages reach the tree tombstoned.

A speculating request's own pages may, for one step, reach past its sequence to hold draft
tokens' K/V (`grow_from_free`); after verification `trim` frees the pages past what it
computed, so only committed tokens ever reach the tree.
"""

from __future__ import annotations

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import MatchResult, PrefixCache
from radixserve.cache.retention import PinTable, session_pin_key
from radixserve.engine.request import Req
from radixserve.engine.stats import EngineStats

UNBOUNDED = 1 << 62  # max_chunk_tokens without a sliding page space: no bound of its own


class ReqPages:
    def __init__(
        self,
        pool: KVPool,
        cache: PrefixCache,
        stats: EngineStats,
        pins: PinTable | None = None,
        use_priority: bool = False,
        pins_give_way: bool = False,
    ):
        self.pool = pool
        self.cache = cache
        self.stats = stats
        self.pins = pins if pins is not None else PinTable(cache, 0)
        self.use_priority = use_priority  # tree nodes take the priority of their requests
        self.pins_give_way = pins_give_way  # pin_policy "last": pins yield to any allocation
        self.holds: dict[Req, object] = {}  # received KV awaiting admission: req -> locked node

    def _priority(self, req: Req) -> int:
        return req.priority if self.use_priority else 0

    def attach(self, req: Req, match: MatchResult) -> None:
        """Gives an admitted request its matched prefix: the (locked) tree pages, as computed."""
        req.page_table = list(match.pages)
        req.num_tree_pages = len(match.pages)
        req.last_node = match.node
        req.num_computed = match.num_tokens
        req.num_sliding_freed = 0
        if req.session_id is not None:
            self.pins.unpin(session_pin_key(req.session_id), req.namespace)

    def load_from_tier(self, match: MatchResult) -> MatchResult:
        """Brings the tier-only part of a (locked) match into the pool, as far as pages can
        be freed, and moves the lock to the deeper node it reaches."""
        if not match.host_tokens:
            return match
        loaded = self.cache.load_back(match, self.ensure_free)
        if loaded.node is not match.node:
            self.cache.lock(loaded.node)
            self.cache.unlock(match.node)
        return loaded

    def hold(self, req: Req, token_ids: list[int]) -> None:
        """Locks the cached pages of `token_ids` (just received for `req`) until `release_hold`."""
        match = self.cache.match_prefix(token_ids, req.namespace, max_tokens=len(token_ids))
        self.cache.lock(match.node)
        self.holds[req] = match.node

    def release_hold(self, req: Req) -> None:
        """Ends `req`'s hold, if any: admitted (its match locks the pages now) or gone."""
        node = self.holds.pop(req, None)
        if node is not None:
            self.cache.unlock(node)

    def ensure_free(self, num: int, unpin: bool = False, take_holds: bool = True) -> bool:
        """Evicts unlocked, unpinned cache pages until `num` pages are free; False if
        impossible. Then holds give way, newest first (unless `take_holds` is False); with
        `unpin` (nothing else can progress) pins too, oldest first."""
        short = num - self.pool.allocator.num_free
        if short > 0:
            self.stats.evicted_pages += self.cache.evict(short)
        while take_holds and self.holds and self.pool.allocator.num_free < num:
            self.release_hold(next(reversed(self.holds)))
            self.stats.evicted_pages += self.cache.evict(num - self.pool.allocator.num_free)
        unpin = unpin or self.pins_give_way
        while unpin and self.pool.allocator.num_free < num and self.pins.release_oldest():
            self.stats.evicted_pages += self.cache.evict(num - self.pool.allocator.num_free)
        return self.pool.allocator.num_free >= num

    def grow(self, req: Req, num_new: int, unpin: bool = False) -> bool:
        """Allocates the pages `num_new` more tokens of `req` need; False if memory is short."""
        missing = self.pool.num_pages_for(req.num_computed + num_new) - len(req.page_table)
        if missing > 0:
            if not self.ensure_free(missing, unpin):
                return False
            req.page_table = req.page_table + self.pool.allocator.allocate(missing).tolist()
        return True

    def grow_from_free(self, req: Req, num_new: int) -> bool:
        """`grow`, from free pages only: what a draft may take without evicting the cache."""
        missing = self.pool.num_pages_for(req.num_computed + num_new) - len(req.page_table)
        if missing > self.pool.allocator.num_free:
            return False
        return self.grow(req, num_new)

    def trim(self, req: Req) -> None:
        """Frees the own pages past the request's computed tokens (a rejected draft's tail).
        Tree pages hold computed tokens only, so they are never trimmed."""
        keep = max(self.pool.num_pages_for(req.num_computed), req.num_tree_pages)
        if len(req.page_table) > keep:
            self.pool.allocator.free(req.page_table[keep:])
            req.page_table = req.page_table[:keep]

    def release(self, req: Req) -> None:
        """Gives the request's computed full pages to the tree and frees the rest."""
        num_full = req.num_computed // self.pool.page_size
        to_free = req.page_table[num_full:]
        if num_full:
            present = self.cache.insert(
                req.seq_ids()[: num_full * self.pool.page_size],
                req.page_table[:num_full],
                req.namespace,
                self._priority(req),
            )
            to_free += req.page_table[req.num_tree_pages : max(present // self.pool.page_size, 0)]
        else:
            to_free = req.own_pages()
        self.pool.allocator.free(to_free)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.page_table, req.num_tree_pages, req.last_node = [], 0, None
        req.num_sliding_freed = 0

    def max_chunk_tokens(self) -> int:
        """The longest prefill chunk the pool can always take: with a sliding page space, a
        chunk's pages need their sliding pages at once, beside the window above its match
        (and one page of slack), so a lone request never waits for pages that cannot exist."""
        window = self.pool.sliding_window
        if window is None:
            return UNBOUNDED
        size = self.pool.page_size
        return (self.pool.allocator.sliding.capacity - -(-window // size) - 2) * size

    def free_out_of_window(self, req: Req) -> None:
        """Frees the sliding K/V of the request's own pages that end before its window (the
        positions its next token reads); nothing without a sliding page space."""
        window = self.pool.sliding_window
        if window is None:
            return
        size = self.pool.page_size
        end = (req.num_computed - window) // size  # pages [0, end) end before the window
        start = max(req.num_tree_pages, req.num_sliding_freed)
        if end > start:
            self.pool.allocator.free_sliding(req.page_table[start:end])
            req.num_sliding_freed = end
        held = len(req.page_table) - max(start, end)
        self.stats.max_req_sliding_pages = max(self.stats.max_req_sliding_pages, held)

    def retain(self, req: Req) -> None:
        """Pins a finished request's cached sequence, if it asked for retention."""
        if req.pin is not None:
            num_cached = req.num_computed // self.pool.page_size * self.pool.page_size
            tokens = req.seq_ids()[:num_cached]
            self.pins.pin(req.pin.key, tokens, req.namespace, req.pin.ttl_s)

    def cache_unfinished(self, req: Req) -> None:
        """Puts a running request's computed full pages into the tree, so others can hit them."""
        num_full = req.num_computed // self.pool.page_size
        if not self.cache.shares_prefixes or num_full <= req.num_tree_pages:
            return
        seq = req.seq_ids()[: num_full * self.pool.page_size]
        priority = self._priority(req)
        present = self.cache.insert(seq, req.page_table[:num_full], req.namespace, priority)
        match = self.cache.match_prefix(seq, req.namespace, max_tokens=len(seq))
        self.pool.allocator.free(
            req.page_table[req.num_tree_pages : present // self.pool.page_size]
        )
        self.cache.lock(match.node)
        self.cache.unlock(req.last_node)
        req.page_table = list(match.pages) + req.page_table[num_full:]
        req.num_tree_pages, req.last_node = num_full, match.node
