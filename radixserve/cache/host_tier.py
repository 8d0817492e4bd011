"""HostTier: the second KV tier below the pool, fixed page slots in host memory or a file.

A slot holds one pool page's K and V of every layer, laid out as `KVPool.read_pages` gives
it (and as disaggregation ships a page):

    data: [num_slots, page_nbytes] uint8      slot s = [2, layers, page_size, kv_heads, head_dim]
    crc:  [num_slots] CRC32 of each slot's bytes, set when the slot is written

Without a folder the slots live in anonymous host memory. With one (`--hicache-dir`) they
are a memory-mapped file, `kv_tier.bin` (owner-only, its disk blocks allocated up front),
locked against a second process; the radix cache saves an index of what the slots hold
beside it (cache/tier_index.py), so that a restarted server finds its prefixes again.
Beside a CUDA pool the anonymous tier is pinned host memory; copies are synchronous
everywhere (overlapping them with the forward, as SGLang does on GPU, is not done), which is
what runs on CPU.

The tier only stores and hands out slots; which pages to keep, and the LRU that picks what
goes when it is full, belong to the radix cache that owns it (cache/hiradix_cache.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import zlib
from dataclasses import asdict, dataclass

import numpy as np
import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import CacheIntegrityError
from radixserve.config import HiCacheConfig
from radixserve.config.cache import CPU_KV_MEMORY_FRACTION
from radixserve.native.machine import GiB, check_fits

logger = logging.getLogger(__name__)

TIER_FILE = "kv_tier.bin"


class TierFullError(RuntimeError):
    """The tier has fewer free slots than were asked for."""


@dataclass(frozen=True)
class TierLayout:
    """What one slot holds: a KV page of every layer, in `dtype` (a torch dtype's name)."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return int(np.prod(self.page_shape)) * itemsize

    def to_dict(self) -> dict:
        return asdict(self)


class HostTier:
    """Page slots with a free list and a checksum per slot; see the module docstring."""

    def __init__(
        self,
        layout: TierLayout,
        num_slots: int,
        folder: str | None = None,
        pin_memory: bool = False,
    ):
        """`pin_memory`: page-locked host memory (a CUDA pool copies to and from it faster);
        only without a folder, and only where CUDA is available."""
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot; got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.folder = folder
        self.pin_memory = pin_memory and folder is None
        self._lock_fd: int | None = None
        self._mmap: np.memmap | None = None
        self.data = self._storage(num_slots, layout.page_nbytes)  # [num_slots, page_nbytes]
        self.crc = np.zeros(num_slots, dtype=np.uint32)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._is_free = np.ones(num_slots, dtype=bool)
        self.bytes_written = 0  # pool -> tier
        self.bytes_read = 0  # tier -> pool

    def _storage(self, num_slots: int, page_nbytes: int) -> torch.Tensor:
        if self.folder is None:
            # not zeroed: a slot is read only once written, so its pages are taken as the tier
            # fills, like the pool's (create_host_tier's check counts them all at start)
            shape = (num_slots, page_nbytes)
            return torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin_memory)
        path = os.path.join(self.folder, TIER_FILE)
        self._lock_fd = _lock_exclusive(path)
        try:
            _allocate_file(self._lock_fd, path, num_slots * page_nbytes)
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_slots, page_nbytes))
        return torch.from_numpy(self._mmap)

    @property
    def path(self) -> str | None:
        return None if self.folder is None else os.path.join(self.folder, TIER_FILE)

    # ---- slots ----

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        """`num` free slots; raises TierFullError if short."""
        if num > len(self._free):
            raise TierFullError(f"asked for {num} tier slots; {len(self._free)} are free")
        slots = [self._free.pop() for _ in range(num)]
        self._is_free[slots] = False
        return slots

    def claim(self, slots: list[int]) -> None:
        """Marks specific free slots used (a restart rebuilding what the file holds)."""
        if any(not self._is_free[s] for s in slots):
            raise ValueError("claim of a tier slot that is in use")
        self._is_free[slots] = False
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]

    def free(self, slots: list[int]) -> None:
        """Returns slots to the free list; raises ValueError on a double free."""
        if any(self._is_free[s] for s in slots) or len(set(slots)) != len(slots):
            raise ValueError("double free of a tier slot")
        self._is_free[slots] = True
        self._free.extend(reversed(slots))

    def used_slots(self) -> list[int]:
        return np.flatnonzero(~self._is_free).tolist()

    # ---- data ----

    def write(self, slots: list[int], kv: torch.Tensor) -> None:
        """Stores pages `kv` ([len(slots), *page_shape], as `KVPool.read_pages` gives) and
        records their checksums."""
        raw = kv.detach().to("cpu", self.layout.torch_dtype).contiguous().view(torch.uint8)
        raw = raw.view(len(slots), -1)
        index = torch.as_tensor(slots, dtype=torch.int64)
        _words(self.data).index_copy_(0, index, _words(raw))
        for slot, row in zip(slots, raw):
            self.crc[slot] = zlib.crc32(row.numpy())
        self.bytes_written += raw.numel()

    def read(self, slots: list[int]) -> torch.Tensor:
        """The pages in `slots`: [len(slots), *page_shape] in the layout's dtype (a copy)."""
        raw = _words(self.data).index_select(0, torch.as_tensor(slots, dtype=torch.int64))
        self.bytes_read += len(slots) * self.layout.page_nbytes
        return raw.view(self.layout.torch_dtype).view(len(slots), *self.layout.page_shape)

    def checksum(self, slot: int) -> int:
        """The CRC32 of what `slot` holds now (recomputed from its bytes)."""
        return zlib.crc32(self.data[slot].numpy())

    def bad_slots(self, slots: list[int]) -> list[int]:
        """The slots whose bytes no longer match the checksum recorded when written."""
        return [s for s in slots if self.checksum(s) != int(self.crc[s])]

    # ---- lifetime ----

    def flush(self) -> None:
        """Writes the mapped file's dirty pages to disk and waits for them (no-op in
        memory); raises OSError when the disk reports an error."""
        if self._mmap is not None:
            self._mmap.flush()
            os.fsync(self._lock_fd)

    def close(self) -> None:
        """Flushes (a failure is logged: the index saved before it names only what was
        flushed then) and releases the file and its lock."""
        try:
            self.flush()
        except OSError as exc:
            logger.warning("hicache: flushing the tier file %s failed: %s", self.path, exc)
        self._mmap = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def check_slot_accounting(tier: HostTier, owned: list[int]) -> None:
    """Each tier slot is free or held by exactly one node (`owned`: the slots the nodes
    hold), and holds what was written."""
    if len(set(owned)) != len(owned):
        raise CacheIntegrityError("a tier slot is held by more than one node")
    if sorted(owned) != tier.used_slots():
        raise CacheIntegrityError(
            f"tier slots leaked or lost: {len(owned)} held by nodes, "
            f"{len(tier.used_slots())} in use"
        )
    bad = tier.bad_slots(owned)
    if bad:
        raise CacheIntegrityError(f"tier slots {bad[:10]} fail their checksum")


def _words(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows viewed as int32 where their length allows: torch copies rows of words
    several times faster than rows of bytes."""
    return rows.view(torch.int32) if rows.shape[-1] % 4 == 0 else rows


def _lock_exclusive(path: str) -> int:
    """Opens (creating, owner-only: it holds every tenant's KV) the tier file and locks it:
    two servers must not share a tier."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ValueError(
            f"--hicache-dir {os.path.dirname(path)!r} is in use by another process ({path} is "
            "locked); give each server its own folder"
        ) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allocate_file(fd: int, path: str, size: int) -> None:
    """Gives the tier file `size` bytes of real disk blocks now, so that a disk filling up
    later can never fault a write into the mapping (SIGBUS). A file of another size (a tier
    sized from a pool that differs a little between starts) keeps its first `size` bytes: the
    slots both sizes have keep what they held, for the saved index to find; slots past the
    old end read zero."""
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise ValueError(
            f"--hicache-dir {os.path.dirname(path)!r}: cannot allocate the {size}-byte tier "
            f"file {path} ({exc.strerror or exc}); free disk space or lower --hicache-size / "
            "--hicache-ratio"
        ) from exc


def create_host_tier(pool: KVPool, config: HiCacheConfig) -> HostTier:
    """The tier below `pool`, sized and placed by `--hicache-*` (in memory: refused at start
    when larger than the memory available)."""
    s = pool.shape
    dtype = str(pool.dtype).removeprefix("torch.")
    layout = TierLayout(s.num_layers, s.page_size, s.num_kv_heads, s.head_dim, dtype)
    num_slots = config.num_tier_pages(pool.allocator.capacity, layout.page_nbytes)
    if config.hicache_dir is None:
        pool_bytes = (pool.k.nbytes + pool.v.nbytes) if pool.device.type == "cpu" else 0
        _check_host_memory(config, num_slots * layout.page_nbytes, pool_bytes)
    return HostTier(layout, num_slots, config.hicache_dir, pin_memory=pool.device.type == "cuda")


def _check_host_memory(config: HiCacheConfig, tier_bytes: int, pool_bytes: int) -> None:
    """An in-memory tier larger than the memory available is refused at start, naming the
    flag that sized it (as SGLang refuses a host pool past its budget), where allocating it
    would fail with the allocator's error or leave the machine to the OOM killer. A CPU
    pool's `pool_bytes` count too: allocated, but its pages are taken only as it fills, so
    the memory available now still holds them (a tier filling it got the process killed
    once the pool filled)."""
    if config.hicache_size > 0:
        flag = f"--hicache-size {config.hicache_size}"
    else:
        flag = f"--hicache-ratio {config.hicache_ratio} (of the KV pool's pages)"
    beside = f" beside the KV pool's {pool_bytes / GiB:.1f} GiB" if pool_bytes else ""
    check_fits(
        tier_bytes + pool_bytes,
        torch.device("cpu"),  # host memory, whatever the pool's device
        f"{flag}: the host tier ({tier_bytes / GiB:.1f} GiB){beside}",
        "lower it, give the KV pool a size (--max-total-tokens; on CPU --cpu-kv-cache-gb, "
        f"else it shares {CPU_KV_MEMORY_FRACTION:.0%} of the memory available with a tier "
        "sized by --hicache-ratio), or put the tier on disk with --hicache-dir",
    )
