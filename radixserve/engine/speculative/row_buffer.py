"""RowBuffer: rows of consecutive positions that grow at the end a few at a time and are cut
from either end, in one tensor with spare room, so that a decode step's append copies its
own rows only (EAGLE keeps each request's captured hidden states in one: eagle.py)."""

from __future__ import annotations

import torch

MIN_CAPACITY = 16


class RowBuffer:
    """Rows [len, width] held at buf[offset : offset + len]; `rows` views them."""

    def __init__(self, rows: torch.Tensor):
        self._buf = rows.new_empty(max(2 * len(rows), MIN_CAPACITY), rows.shape[1])
        self._buf[: len(rows)] = rows
        self._offset, self._len = 0, len(rows)

    def __len__(self) -> int:
        return self._len

    @property
    def rows(self) -> torch.Tensor:
        """The rows, a view: valid until the next put."""
        return self._buf[self._offset : self._offset + self._len]

    def put(self, at: int, rows: torch.Tensor) -> None:
        """Keeps the first `at` rows (0 <= at <= len), then `rows`."""
        if not 0 <= at <= self._len:
            raise ValueError(f"at must be within 0 .. {self._len}; got {at}")
        size = at + len(rows)
        if self._offset + size > len(self._buf):  # no room at the end: start a new buffer
            buf = self._buf.new_empty(max(2 * size, MIN_CAPACITY), self._buf.shape[1])
            buf[:at] = self._buf[self._offset : self._offset + at]
            self._buf, self._offset = buf, 0
        start = self._offset + at
        self._buf[start : start + len(rows)] = rows
        self._len = size

    def drop_front(self, num: int) -> None:
        """Forgets the first `num` rows (0 <= num <= len)."""
        if not 0 <= num <= self._len:
            raise ValueError(f"num must be within 0 .. {self._len}; got {num}")
        self._offset += num
        self._len -= num

    def clear(self) -> None:
        self._offset = self._len = 0
