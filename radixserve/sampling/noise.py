"""The sampler's seeded noise: U(0, 1) and Gumbel noise that are a counter-based hash of (seed,
step, vocab index), computed with int64 tensor ops on the logits' device, so a request's
draws depend only on its own seed and step.

torch has no uint64: int64 holds the bit patterns; + and * wrap mod 2^64 like unsigned ones,
and right shifts are made logical by masking off the copied sign bits. On CPU, once the C++
kernels are loaded (never loaded from here), `uniform_noise_at` runs csrc/seeded_noise.cpp:
the same bits, in one pass.
"""

from __future__ import annotations

import torch

from radixserve.native.extension import loaded_cpu_ops


def as_int64(value: int) -> int:
    """The signed int64 with the same low 64 bits as `value`."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_MUL_A = as_int64(0xFF51AFD7ED558CCD)
_MUL_B = as_int64(0xC4CEB9FE1A85EC53)
_STEP_STRIDE = as_int64(0x9E3779B97F4A7C15)  # odd: distinct steps give distinct counters
_VOCAB_STRIDE = as_int64(0xD1B54A32D192ED03)
_SEED_SALT = as_int64(0x5EED5EED5EED5EED)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """Avalanche finalizer (xorshift-multiply rounds): every output bit depends on every input."""
    x = x ^ _shift_right(x, 33)
    x = x * _MUL_A
    x = x ^ _shift_right(x, 33)
    x = x * _MUL_B
    return x ^ _shift_right(x, 33)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) per (seed, step, vocab index) from the top 24 bits of a hash; [B, V] float32."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return uniform_noise_at(seeds, steps, vocab[None, :])


def uniform_noise_at(seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`uniform_noise` at the vocab indices `ids` only ([B, K] or [1, K] for all rows): the
    same values, without hashing the rest of the vocabulary. [B, K] float32."""
    keys = row_keys(seeds, steps)
    ops = loaded_cpu_ops() if ids.device.type == "cpu" else None
    if ops is not None:  # the same values in one pass (csrc/seeded_noise.cpp)
        return ops.uniform_noise_at(keys, ids)
    return hashed_uniform(keys, ids)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's hash key: its seed and step mixed. [B] int64."""
    return _mix64(_mix64(seeds ^ _SEED_SALT) + steps * _STEP_STRIDE)


def hashed_uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) of (row key, vocab index) in torch ops (any device). [B, K] float32."""
    bits = _shift_right(_mix64(keys[:, None] + ids * _VOCAB_STRIDE), 40)  # in [0, 2^24)
    # (bits + 0.5) can round up to 2^24 in float32; the clamp keeps u < 1 so log(u) < 0.
    return ((bits.float() + 0.5) * 2.0**-24).clamp_(max=1 - 2.0**-24)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(logits + noise) is a draw from softmax(logits). [B, V]."""
    return gumbel_from_uniform(uniform_noise(seeds, steps, vocab_size))


def gumbel_from_uniform(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from U(0, 1) noise of the same shape."""
    return -torch.log(-torch.log(uniform))
