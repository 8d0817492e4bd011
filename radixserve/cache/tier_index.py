"""The index that makes a tier file survive a restart: which radix paths its slots hold.

    kv_tier_index.json  {"version", "identity": {model fingerprint, tier layout, slots},
                         "entries": [[parent, namespace, key tokens, slots, crc32s], ...]}

Entries come parents first (`parent` indexes an earlier entry, -1: a namespace root). On
load, an index whose identity differs from the running server's (another model, weights,
page size, KV dtype or shape) or that does not parse is discarded with a warning; an entry
whose slots no longer match their checksums (the file changed after the save, or rotted), or
lie past the end of a tier smaller than the saved one, is dropped with a warning, and so is
everything below it. The tier's size is not part of the identity: on CPU it follows the KV
pool, which is sized from the memory available at start and so differs a little between two
starts of the same server. Nothing unverified is
ever used; so is nothing of a file that does not parse, whatever its shape or types. The
index is written owner-only to a temporary file, fsynced (after the tier file) and renamed,
so a crash never leaves half of one, nor an index naming pages the disk never got.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.cache.host_tier import HostTier
    from radixserve.cache.tree_node import RootNode

logger = logging.getLogger(__name__)

INDEX_VERSION = 1


@dataclass(frozen=True)
class TierEntry:
    """One tier node: its key (whole pages of tokens) and the slots (and CRCs) of its pages."""

    parent: int  # index of the parent entry; -1: under the namespace's root
    namespace: str | None
    key: list[int]
    slots: list[int]
    crcs: list[int]


def tier_identity(tier: HostTier, model_fingerprint: str) -> dict:
    """What a saved tier must match to be used: the model and the slots' layout. The slot
    count is saved too (`num_slots`) but need not match: slots past the end are dropped."""
    return {"model": model_fingerprint, "layout": tier.layout.to_dict()}


def tier_entries(roots: list[RootNode], tier: HostTier) -> list[TierEntry]:
    """The tier nodes under `roots` whose whole path is in the tier, parents before children."""
    entries: list[TierEntry] = []
    stack = [(child, -1, root.namespace) for root in roots for child in root.children.values()]
    while stack:
        node, parent, namespace = stack.pop()
        if node.host_slots is None:
            continue
        crcs = [int(tier.crc[s]) for s in node.host_slots]
        entries.append(TierEntry(parent, namespace, list(node.key), node.host_slots, crcs))
        stack.extend((child, len(entries) - 1, namespace) for child in node.children.values())
    return entries


def save_tier_index(path: str, identity: dict, tier: HostTier, entries: list[TierEntry]) -> None:
    """Writes the index owner-only to a temporary file, fsyncs it, renames it into place and
    fsyncs the folder; raises OSError (the old index stays) when the disk refuses."""
    rows = [[e.parent, e.namespace, e.key, e.slots, e.crcs] for e in entries]
    saved = identity | {"num_slots": tier.num_slots}
    document = {"version": INDEX_VERSION, "identity": saved, "entries": rows}
    data = json.dumps(document, separators=(",", ":")).encode()
    tmp = path + ".tmp"
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _write_synced(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def load_tier_index(path: str, identity: dict, tier: HostTier) -> list[TierEntry]:
    """The verified entries of the index at `path`; [] if there is none or it is unusable
    (then it is deleted, with a warning saying why)."""
    if not os.path.exists(path):
        return []
    try:
        entries = _read_entries(path, identity)
    except ValueError as exc:
        logger.warning("hicache: discarding the saved tier %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.remove(path)
        return []
    return _verified(entries, tier)


def _read_entries(path: str, identity: dict) -> list[TierEntry]:
    try:
        with open(path, "rb") as f:
            document = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8
        raise ValueError(f"unreadable index ({type(exc).__name__}: {exc})") from exc
    if not isinstance(document, dict):
        raise ValueError("unreadable index (not a JSON object)")
    version, saved = document.get("version"), document.get("identity")
    if version != INDEX_VERSION:
        raise ValueError(f"index version {version!r}, expected {INDEX_VERSION}")
    if not isinstance(saved, dict):
        raise ValueError("unreadable index (no identity object)")
    changed = sorted(k for k in identity if saved.get(k) != identity[k])
    if changed:
        raise ValueError(f"it belongs to another setup (differs in: {', '.join(changed)})")
    rows = document.get("entries")
    if not isinstance(rows, list):
        raise ValueError("unreadable index (entries is not a list)")
    entries = [_entry(i, row) for i, row in enumerate(rows)]
    _check_shapes(entries, identity["layout"]["page_size"])
    return entries


def _entry(i: int, row: object) -> TierEntry:
    """One index row, every field's type checked: whatever the file holds, a bad row is a
    ValueError naming it, never a crash further on."""
    if not isinstance(row, list) or len(row) != 5:
        raise ValueError(f"entry {i} is not [parent, namespace, key, slots, crcs]")
    parent, namespace, key, slots, crcs = row
    if not _is_int(parent) or not (namespace is None or isinstance(namespace, str)):
        raise ValueError(f"entry {i} has a bad parent or namespace")
    for name, values, bound in (
        ("key", key, 2**63),
        ("slots", slots, 2**63),
        ("crcs", crcs, 2**32),
    ):
        if not isinstance(values, list) or not all(_is_int(v) and 0 <= v < bound for v in values):
            raise ValueError(f"entry {i}'s {name} is not a list of non-negative integers")
    return TierEntry(parent, namespace, key, slots, crcs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shapes(entries: list[TierEntry], page_size: int) -> None:
    """Parents first, keys of whole pages, one slot and CRC per page, no slot twice (a slot
    past the tier's end is not an error here: `_verified` drops its entry)."""
    seen: set[int] = set()
    for i, e in enumerate(entries):
        num_pages = len(e.key) // page_size
        if not -1 <= e.parent < i or not e.key or len(e.key) % page_size:
            raise ValueError(f"entry {i} has a bad parent or key")
        if len(e.slots) != num_pages or len(e.crcs) != num_pages:
            raise ValueError(f"entry {i} has {len(e.slots)} slots for {num_pages} pages")
        for s in e.slots:
            if s in seen:
                raise ValueError(f"entry {i} names a slot used twice")
            seen.add(s)


def _verified(entries: list[TierEntry], tier: HostTier) -> list[TierEntry]:
    """`entries` but those with a slot past the tier's end (a smaller tier than the saved
    one) or failing a checksum, and everything below them, parents renumbered; the kept
    slots' checksums become the tier's."""
    kept: list[TierEntry] = []
    new_index: dict[int, int] = {}
    beyond = failed = 0
    for i, e in enumerate(entries):
        parent = -1 if e.parent < 0 else new_index.get(e.parent)
        if parent is None:
            continue
        if any(s >= tier.num_slots for s in e.slots):
            beyond += 1
            continue
        if any(tier.checksum(s) != c for s, c in zip(e.slots, e.crcs)):
            failed += 1
            continue
        tier.crc[e.slots] = e.crcs
        new_index[i] = len(kept)
        kept.append(TierEntry(parent, e.namespace, e.key, e.slots, e.crcs))
    if len(kept) < len(entries):
        logger.warning(
            "hicache: %d saved tier nodes were dropped: %d failed their checksums, %d lie "
            "past the end of this %d-slot tier (smaller than the saved one), the rest hang "
            "below those",
            len(entries) - len(kept),
            failed,
            beyond,
            tier.num_slots,
        )
    return kept
