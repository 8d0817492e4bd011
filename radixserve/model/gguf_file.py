"""A GGUF file's metadata and tensors, read with `struct` over a memory map.

gguf's own `GGUFReader` builds a numpy view per value of every field, ~2.8 s for SmolLM2's
49,152-token vocabulary and merges on every server start; this reads the same file in a few
hundred ms. Fields are plain Python values; tensors keep the reader's conventions (`shape` in
ggml order, `data` a read-only view of the mapped file: the element dtype for fp / int types,
[rows, bytes per row] uint8 for block-quantized ones). Little-endian files (what llama.cpp
writes) only.

The file is mapped copy-on-write (MAP_PRIVATE): its pages are the page cache's, shared by every
process that maps the file, and nothing written through the map could reach the file.
A tensor's `torch_bytes` gives its bytes as a torch tensor over the map (no copy), which the loader
keeps as a layer's weights (K-quant blocks): the weights then cost file-backed pages, not
anonymous memory. A layer that copies its bytes into another layout (KQuantLinear.repack_rows8)
gives the old view's pages back with `release_pages`, as llama.cpp unmaps what it repacks.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAPS: list[tuple[weakref.ref, int, int]] = []  # every opened file's map: (map, address, size)
_PLAIN_DTYPES = {  # ggml type -> element dtype (the rest are block-quantized bytes)
    0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
    28: np.float64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml order: shape[0] is the row length
    data: np.ndarray  # read-only view of the mapped file
    offset: int = 0  # where `data` starts in the file
    buffer: mmap.mmap | None = field(default=None, repr=False, compare=False)  # the file's map

    def torch_bytes(self) -> torch.Tensor:
        """A block-quantized tensor's bytes, [rows, bytes per row] uint8 like `data`, as a torch
        tensor over the mapped file (no copy; it keeps the map alive). Its pages are the
        file's: nothing may write to it (a write would copy the page into this process, never
        into the file)."""
        import torch

        if self.data.dtype != np.uint8 or self.buffer is None:
            raise ValueError(f"{self.name} is {self.tensor_type.name}, not block-quantized")
        count = self.data.nbytes
        flat = torch.frombuffer(self.buffer, dtype=torch.uint8, count=count, offset=self.offset)
        return flat.view(*self.data.shape)


class GGUFFile:
    """`fields` (key -> value) and `tensors` of one GGUF file; raises ValueError if malformed."""

    def __init__(self, path: Path | str):
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        _MAPS[:] = [entry for entry in _MAPS if entry[0]() is not None]
        _MAPS.append((weakref.ref(self._buf), _address(self._buf), len(self._buf)))
        self._pos = 0
        if self._read(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = self._unpack("I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (big-endian file?)")
        num_tensors, num_fields = self._unpack("Q"), self._unpack("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment}")
        data_start = -(-self._pos // alignment) * alignment
        mapped = np.frombuffer(self._buf, dtype=np.uint8)
        mapped.flags.writeable = False  # numpy views: read-only, as gguf's own reader has them
        self.tensors = [self._tensor(mapped, data_start, *info) for info in infos]

    def _read(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("truncated GGUF file")
        data, self._pos = self._buf[self._pos : end], end
        return data

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self._read(size))[0]

    def _string(self) -> str:
        return self._read(self._unpack("Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self._unpack("I"), self._unpack("Q")
        if item_kind in _SCALARS:  # one unpack for the whole array
            fmt = f"<{count}{_SCALARS[item_kind]}"
            return list(struct.unpack_from(fmt, self._read(struct.calcsize(fmt))))
        return [self._value(item_kind) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
        return name, dims, self._unpack("I"), self._unpack("Q")

    def _tensor(self, mapped: np.ndarray, start: int, name: str, dims, kind: int, offset: int):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        ggml_type = GGMLQuantizationType(kind)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        num_elements = int(np.prod(dims))
        num_bytes = num_elements * type_size // block_size
        first = start + offset
        if first + num_bytes > len(mapped):
            raise ValueError(f"tensor {name} runs past the end of the file")
        raw = mapped[first : first + num_bytes]
        np_dims = tuple(reversed(dims))
        if kind in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[kind]).reshape(np_dims)
        else:  # rows of blocks: the last dimension in bytes
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block_size * type_size)
        dims_array = np.array(dims, dtype=np.uint64)
        return GGUFTensor(name, ggml_type, dims_array, data, first, self._buf)


def _address(buffer: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(buffer)  # an export while it lives: dropped at once
    try:
        return ctypes.addressof(pointer)
    finally:
        del pointer


def release_pages(view: torch.Tensor) -> int:
    """Drops this process's resident pages that lie wholly inside `view`, if it is a view of
    a GGUF file's map (madvise DONTNEED: the pages are the file's and never written, so a
    later read maps them again from the page cache); any other tensor is left alone. Returns
    the bytes released."""
    start, size = view.data_ptr(), view.numel() * view.element_size()
    for ref, address, length in _MAPS:
        buffer = ref()
        if buffer is None or not address <= start <= start + size <= address + length:
            continue
        first = -(-(start - address) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (start + size - address) // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            return 0
        buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
        return last - first
    return 0
