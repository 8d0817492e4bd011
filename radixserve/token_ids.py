"""Helpers over token-id sequences shared by the scheduler and the frontend language."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
