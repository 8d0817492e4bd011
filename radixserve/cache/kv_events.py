"""KV events: which whole pages enter and leave the radix tree, for KV-aware routers.

The structs are vLLM's (vllm/distributed/kv_events.py), so a router that reads vLLM's events
reads ours: msgspec tagged array-like structs, one `KVEventBatch` per message. A page is a
vLLM block; only whole pages are ever in the tree, so every page is an event.

Each page is named by a hash chained over the page-aligned prefix it ends:

    root(ns) ── (a b | c d) ── (e f)        page_size 2
    BlockStored(block_hashes=[h1, h2], parent_block_hash=None, token_ids=[a, b, c, d], ...)
    BlockStored(block_hashes=[h3], parent_block_hash=h2, token_ids=[e, f], ...)
    h1 = H(ns; a b)   h2 = H(h1; c d)   h3 = H(h2; e f)

H is sha256 (stable across processes, unlike Python's salted `hash`) truncated to 64 bits as
vLLM does (its last 8 bytes, big-endian). A namespace (cache salt) enters the first page's
hash only, as vLLM's `cache_salt`, so different namespaces never share a hash. A node keeps
its pages' hashes (`block_hashes`) so that removals and children need no rehashing; nodes get
them only while events are on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

# ---- vLLM's wire structs ----


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (the class name) is each event's first array item."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def device_medium(device_type: str) -> str:
    """vLLM's `medium` for pages in a pool on `device_type`: "GPU" on CUDA, else "CPU"."""
    return "GPU" if device_type == "cuda" else "CPU"


# ---- hashes ----


def block_hash(parent: int | None, token_ids: Sequence[int], namespace: str | None = None) -> int:
    """The 64-bit hash of one page whose prefix ends in `parent` (None: the first page, then
    `namespace` is mixed in instead)."""
    if parent is None:
        salt = b"" if namespace is None else namespace.encode()
        head = b"\x00" + struct.pack("<I", len(salt)) + salt
    else:
        head = b"\x01" + parent.to_bytes(8, "big")
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(head + body).digest()[-8:], "big")


def chain_hashes(
    parent: int | None, token_ids: Sequence[int], page_size: int, namespace: str | None = None
) -> list[int]:
    """The hashes of the whole pages of `token_ids`, chained on from `parent`."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[start : start + page_size], namespace)
        hashes.append(parent)
    return hashes


# ---- the cache's observer ----


class KVEventSink:
    """What a RadixCache tells when pages enter or leave it; `emit` gets each event (the
    publisher's non-blocking `publish`). Nodes are the cache's: `key`, `parent` (a root has
    none, and a `namespace`), `block_hashes`. Without `include_token_ids`, BlockStored
    carries the hashes only (`token_ids` empty): a subscriber learns no prompt text."""

    def __init__(
        self,
        page_size: int,
        medium: str,
        emit: Callable[[KVCacheEvent], Any],
        include_token_ids: bool = True,
    ):
        self.page_size = page_size
        self.medium = medium
        self.emit = emit
        self.include_token_ids = include_token_ids

    def stored(self, node: Any) -> None:
        """`node` (with a parent in the tree) just took ownership of its pages."""
        parent = node.parent
        if parent.parent is None:  # top-level: the chain starts here
            node.block_hashes = chain_hashes(None, node.key, self.page_size, parent.namespace)
            parent_hash = None
        else:
            parent_hash = parent.block_hashes[-1]
            node.block_hashes = chain_hashes(parent_hash, node.key, self.page_size)
        self.emit(
            BlockStored(
                block_hashes=list(node.block_hashes),
                parent_block_hash=parent_hash,
                token_ids=list(node.key) if self.include_token_ids else [],
                block_size=self.page_size,
                lora_id=None,
                medium=self.medium,
            )
        )

    def removed(self, node: Any, medium: str | None = None) -> None:
        """`node`'s pages left `medium` (default: this pool's)."""
        self.emit(BlockRemoved(block_hashes=list(node.block_hashes), medium=medium or self.medium))

    def cleared(self) -> None:
        """Every page left the cache (reset / flush_cache)."""
        self.emit(AllBlocksCleared())
