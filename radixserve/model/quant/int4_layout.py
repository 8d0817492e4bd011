"""Reads back the 4-bit codes from torch's CPU int4 packing, for the dequantize path.

`_convert_weight_to_int4pack_for_cpu` stores an [N, K] code matrix in blocks of BLOCK_N
rows, `[N / BLOCK_N, K, BLOCK_N / 2]` bytes, two codes per byte; how rows pair up in a byte
depends on the SIMD width torch was dispatched to (aten/src/ATen/native/cpu/int4mm_kernel.cpp):

    format   BLOCK_N  byte d of a row-block's k-slice holds (low | high nibble)
    avx512   64       rows d | d + 32     (low nibbles: rows 0-31, high: rows 32-63)
    avx2     32       rows d | d + 16
    pairs    32       rows 2d | 2d + 1    (no SIMD; also every partial last block)

The format is not guessed from CPU flags: `packing_format()` packs a probe with torch's own
packer once and keeps the format whose unpacking gives the probe back (None if none does;
callers then keep to torch's kernel, which is always correct, only slower for many rows).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

FORMATS = {"avx512": 64, "avx2": 32, "pairs": 32}
_PROBE_SHAPE = (64 + 48, 64)  # one full 64-row block + a 48-row tail; 3 full 32-row blocks + 16


def _lanes(low: torch.Tensor, high: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., B/2] low and high nibbles -> [..., B] codes in row order."""
    if fmt in ("avx512", "avx2"):  # first half of the rows low, second half high
        return torch.cat([low, high], dim=-1)
    return torch.stack([low, high], dim=-1).flatten(-2)


def unpack_codes(packed: torch.Tensor, n: int, k: int, fmt: str) -> torch.Tensor:
    """torch's packed int4 weight -> [n, k] uint8 codes 0..15."""
    block_n = FORMATS[fmt]
    flat = packed.reshape(-1)
    full = n // block_n * block_n
    parts = []
    if full:
        blocks = flat[: full * k // 2].view(full // block_n, k, block_n // 2)
        rows = _lanes(blocks & 0x0F, blocks >> 4, fmt)  # [blocks, k, block_n]
        parts.append(rows.transpose(1, 2).reshape(full, k))
    if n > full:  # a partial last block is always packed in pairs
        tail = flat[full * k // 2 :].view(k, (n - full) // 2)
        parts.append(_lanes(tail & 0x0F, tail >> 4, "pairs").t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def packing_format() -> str | None:
    """The format torch's CPU int4 packer uses on this machine, found by a round trip."""
    n, k = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for fmt in FORMATS:
        if packed.numel() * 2 == n * k and torch.equal(unpack_codes(packed, n, k, fmt), codes):
            return fmt
    logger.info("torch's CPU int4 packing is not one we can read; int4 stays on its kernel")
    return None
