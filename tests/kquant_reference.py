"""A numpy quantizer for GGUF's Q4_K, Q5_K and Q6_K, following llama.cpp's reference
quantize_row_q4_K_ref / q5_K_ref / q6_K_ref (ggml-quants.c): the `gguf` package dequantizes
K-quants but cannot quantize them, and the tests write tiny K-quant GGUFs with it.

Per super-block of 256 weights, vectorized over every block of a tensor at once:
  Q4_K / Q5_K  per 32 weights, a scale and a min fitted by weighted least squares over a few
               trial scales (make_qkx2_quants), then both quantized to 6 bits against the
               block's fp16 d / dmin, and the 4 / 5-bit codes recomputed with those
  Q6_K         per 16 weights, a signed scale by the best of 19 trial scales
               (make_qx_quants, weights x^2), quantized to int8 against the block's fp16 d
`quantize_kquant(w, type_name)` -> [rows, K / 256 * bytes] uint8, the bytes GGUF stores.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = 1e-15


def nearest(x: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: round half to even."""
    return np.rint(x).astype(np.int32)


def _f16(x: np.ndarray) -> np.ndarray:
    """fp32 -> fp16 -> fp32, as the block's d / dmin are stored and read back."""
    return x.astype(np.float16).astype(np.float32)


def make_qkx2_quants(x, weights, nmax: int, rmin: float, rdelta: float, nstep: int):
    """[S, n] -> (codes [S, n] in 0..nmax, scale [S], min [S] >= 0): x ~ scale * L - min."""
    low, high = np.minimum(x.min(1), 0), x.max(1)
    flat = high == low
    span = np.where(flat, 1, high - low)
    sum_w, sum_x = weights.sum(1), (weights * x).sum(1)
    iscale = nmax / span
    codes = np.clip(nearest(iscale[:, None] * (x - low[:, None])), 0, nmax)
    scale, best_min = 1 / iscale, low.copy()
    best = (weights * (scale[:, None] * codes + low[:, None] - x) ** 2).sum(1)
    for step in range(nstep + 1):
        # as llama.cpp does, each trial starts from the best min so far, not the block's low
        span_now = high - best_min
        iscale = (rmin + rdelta * step + nmax) / np.where(span_now == 0, 1, span_now)
        trial = np.clip(nearest(iscale[:, None] * (x - best_min[:, None])), 0, nmax)
        sum_l, sum_l2 = (weights * trial).sum(1), (weights * trial * trial).sum(1)
        sum_xl = (weights * trial * x).sum(1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, 1)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = np.where(positive, 0, this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), this_scale)
        error = (weights * (this_scale[:, None] * trial + this_min[:, None] - x) ** 2).sum(1)
        better = ok & (error < best)
        codes = np.where(better[:, None], trial, codes)
        best = np.where(better, error, best)
        scale, best_min = np.where(better, this_scale, scale), np.where(better, this_min, best_min)
    codes = np.where(flat[:, None], 0, codes)
    return codes, np.where(flat, 0, scale).astype(np.float32), (-best_min).astype(np.float32)


def make_qx_quants(x, nmax: int):
    """[S, n] -> (codes [S, n] in 0..2 nmax - 1, signed scale [S]): x ~ scale * (L - nmax),
    weights x^2 (llama.cpp's rmse_type 1)."""
    rows = np.arange(len(x))
    peak = x[rows, np.abs(x).argmax(1)]
    empty = np.abs(peak) < GROUP_MAX_EPS
    peak = np.where(empty, 1, peak)
    weights = x * x

    def trial(iscale):
        levels = np.clip(nearest(iscale[:, None] * x), -nmax, nmax - 1)
        return levels, (weights * x * levels).sum(1), (weights * levels * levels).sum(1)

    levels, sumlx, suml2 = trial(-nmax / peak)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0)
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s != 0]:
        new_levels, sumlx, suml2 = trial(-(nmax + 0.1 * step) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better[:, None], new_levels, levels)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, 1), scale)
        best = np.where(better, scale * sumlx, best)
    codes = np.where(empty[:, None], 0, levels + nmax)
    return codes, np.where(empty, 0, scale).astype(np.float32)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """[nb, 8] 6-bit scales and mins -> [nb, 12] bytes (llama.cpp's K_SCALE_SIZE packing)."""
    out = np.zeros((len(ls), 12), dtype=np.uint8)
    out[:, 0:4], out[:, 4:8] = ls[:, :4], lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _quantize_k4(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K / Q5_K's common part: [nb, 256] -> (d, dmin fp16 bytes [nb, 4], scales [nb, 12],
    codes [nb, 256] in 0..nmax)."""
    nb = len(blocks)
    x = blocks.reshape(nb * 8, 32)
    weights = np.sqrt((x * x).mean(1, keepdims=True)) + np.abs(x)
    codes, scales, mins = make_qkx2_quants(x, weights, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = np.maximum(scales.max(1), 0), np.maximum(mins.max(1), 0)
    inv_scale = np.where(max_scale > 0, 63 / np.where(max_scale > 0, max_scale, 1), 0)
    inv_min = np.where(max_min > 0, 63 / np.where(max_min > 0, max_min, 1), 0)
    ls = np.clip(nearest(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(nearest(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    d16, dmin16 = (max_scale / 63).astype(np.float16), (max_min / 63).astype(np.float16)
    d = d16.astype(np.float32)[:, None] * ls
    dm = dmin16.astype(np.float32)[:, None] * lm
    safe = np.where(d == 0, 1, d)[..., None]
    final = np.clip(nearest((blocks.reshape(nb, 8, 32) + dm[..., None]) / safe), 0, nmax)
    codes = np.where((d == 0)[..., None], codes.reshape(nb, 8, 32), final).reshape(nb, QK_K)
    head = np.stack([d16, dmin16], axis=1).view(np.uint8).reshape(nb, 4)
    return head, _pack_scales_k4(ls, lm), codes.astype(np.uint8)


def _nibbles_k4(codes: np.ndarray) -> np.ndarray:
    """[nb, 256] codes -> [nb, 128]: per 64 weights, byte l = code l | code l + 32 << 4."""
    chunks = codes.reshape(len(codes), 4, 2, 32) & 0xF
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(len(codes), 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    head, scales, codes = _quantize_k4(blocks, 15, -1.0, 20)
    return np.concatenate([head, scales, _nibbles_k4(codes)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    head, scales, codes = _quantize_k4(blocks, 31, -0.5, 15)
    high = (codes.reshape(len(codes), 8, 32) >> 4).astype(np.uint8)  # bit u of qh[l]: unit u
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, scales, qh, _nibbles_k4(codes)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    nb = len(blocks)
    x = blocks.reshape(nb * 16, 16)
    codes, scales = make_qx_quants(x, 32)
    codes, scales = codes.reshape(nb, 16, 16), scales.reshape(nb, 16)
    peak = scales[np.arange(nb), np.abs(scales).argmax(1)]
    empty = np.abs(peak) < GROUP_MAX_EPS
    iscale = np.where(empty, 0, -128 / np.where(empty, 1, peak))
    d16 = np.where(empty, 0, 1 / np.where(empty, 1, iscale)).astype(np.float16)
    sc = np.minimum(127, nearest(iscale[:, None] * scales)).astype(np.int8)
    d = d16.astype(np.float32)[:, None] * sc
    safe = np.where(d == 0, 1, d)[..., None]
    final = np.clip(nearest(x.reshape(nb, 16, 16) / safe), -32, 31) + 32
    codes = np.where((d == 0)[..., None], codes, final).reshape(nb, 2, 4, 32).astype(np.uint8)
    codes = np.where(empty[:, None, None, None], 0, codes)  # an all-zero block: all bytes 0
    low = codes & 0xF  # [nb, half, part, 32]: parts 0, 1 low nibbles, 2, 3 high
    ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], 2)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce((codes >> 4) << shifts, axis=2)
    sc = np.where(empty[:, None], 0, sc).astype(np.int8)
    tail = [sc.view(np.uint8), d16[:, None].view(np.uint8)]
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), *tail], axis=1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize_kquant(weight: np.ndarray, type_name: str) -> np.ndarray:
    """[rows, K] (K a multiple of 256) -> [rows, K / 256 * block bytes] uint8."""
    rows, k = weight.shape
    blocks = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, QK_K)
    return QUANTIZERS[type_name](blocks).reshape(rows, -1)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def quantize_iq4_nl(weight: np.ndarray) -> np.ndarray:
    """[rows, K] (K a multiple of 32) -> [rows, K / 32 * 18] uint8 IQ4_NL blocks: fp16 d with
    the block's largest |w| on the table's -127 end, each weight the nearest table entry.
    (Simpler than llama.cpp's search over scales, which the tests do not need: any valid
    blocks are a file the gguf package reads back.)"""
    rows, k = weight.shape
    x = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, 32)
    peak = np.take_along_axis(x, np.abs(x).argmax(1)[:, None], 1)[:, 0]
    d = _f16(peak / IQ4_NL_VALUES[0])
    scaled = x / np.where(d == 0, 1, d)[:, None]
    codes = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    qs = codes[:, :16] | codes[:, 16:] << 4
    d16 = d.astype(np.float16)[:, None].view(np.uint8)
    return np.concatenate([d16, qs], axis=1).reshape(rows, -1)
