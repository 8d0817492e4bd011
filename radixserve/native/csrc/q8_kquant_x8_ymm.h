// Q4_K, Q5_K and Q6_K weights repacked 8 rows at a time (kquant_blocks.h's layouts) on AVX2
// builds without AVX-512: q8_kquant_x8.h's kernels with 256-bit vectors. Each 64-byte piece of
// an x8 super-block is two 32-byte halves, rows 0-3 and rows 4-7 (`Y8Half`); the scale / min
// unpacking, the min sums and the fp32 steps stay vector work shared by the 8 rows, where the
// row layout (q8_formats.h's Q4KRows / Q6KRows) does them per row with scalar code. It gives
// the names q8_matmul.cpp calls with AVX-512 (x8_dot, Q4KX8, Q5KX8, Q6KX8).
//
// Bits: row r's integer lanes 2c, 2c + 1 (codes 8c .. 8c + 7 of every unit, times their
// scale: lanes 2c and 2c + 1 of the row kernels) sit in lanes 2(r % 4), + 1 of its half's
// ints[c]; the fp32 lane sets, the min terms and the final reduction are the row kernels' ops
// in their order, so a repacked weight gives the row layout's bits at any number of rows.
// Needs F16C (every AVX2 CPU has it; the AVX2 build passes -mf16c) for the 8 rows' d / dmin.
#pragma once

#include "q8_kquant_x8.h"

#include <cstdint>
#include <cstring>

namespace radixserve_q8 {

#if !defined(RADIXSERVE_Q8_ZMM) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_Q8_YMM 1

// Rows 4h .. 4h + 3 of a group: row r's integer lanes in lanes 2(r % 4), + 1 of ints[c] (one
// super-block's, written by the block kernels), the two fp32 lane sets likewise.
struct Y8Half {
  __m256i ints[4];
  __m256 sets[2][4];
};
// One activation row against the 8 weight rows: both halves, and the min terms (row r in lane r).
struct Y8Acc {
  Y8Half half[2];
  __m256 mins;
};

// 8 activation codes at xq, in each of the 4 rows' 8 bytes.
inline __m256i y8_codes(const int8_t* xq) {
  int64_t v;
  std::memcpy(&v, xq, sizeof(v));
  return _mm256_set1_epi64x(v);
}
inline __m256i y8_spread(__m256i words, int k) {  // word 4r + i = word 4r + k (4 rows' words)
  return _mm256_shuffle_epi8(words, _mm256_broadcastsi128_si256(spread_pattern(k)));
}
inline __m256i y8_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 y8_halves(const uint8_t* p) {  // 8 fp16 -> fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m128i y8_half_bytes(__m256i v, int h) {  // bytes 16h .. 16h + 15
  return h == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
}

// Set S += (d_r d_x) * the integer lanes, row by row; `dd` the 8 rows' d_r d_x.
template <int S>
inline void y8_scale_ints(Y8Acc& acc, __m256 dd) {
  for (int h = 0; h < 2; ++h) {
    const int r = 4 * h;
    const __m256 dd2 = _mm256_permutevar8x32_ps(
        dd, _mm256_setr_epi32(r, r, r + 1, r + 1, r + 2, r + 2, r + 3, r + 3));
    Y8Half& half = acc.half[h];
    for (int c = 0; c < 4; ++c)
      half.sets[S][c] = _mm256_fmadd_ps(dd2, _mm256_cvtepi32_ps(half.ints[c]), half.sets[S][c]);
  }
}

// Row sums of 8 rows' lane pairs: lanes 2r + j of `lo` (rows 0-3) and `hi` (rows 4-7) -> lane r.
inline __m256i y8_pair_sums(__m256i lo, __m256i hi) {
  const __m256i s = _mm256_hadd_epi32(lo, hi);  // rows 0, 1, 4, 5 | 2, 3, 6, 7
  return _mm256_permute4x64_epi64(s, _MM_SHUFFLE(3, 1, 2, 0));
}

// The 8 rows' results: dsum's order per row, then + 0 (no offsets) + the min terms, as
// dot_rows adds them.
inline __m256 y8_finish(const Y8Acc& acc) {
  __m128 dots[2];
  for (int h = 0; h < 2; ++h) {
    const Y8Half& half = acc.half[h];
    __m256 t[4];
    for (int c = 0; c < 4; ++c) t[c] = _mm256_add_ps(half.sets[0][c], half.sets[1][c]);
    const __m256 u = _mm256_add_ps(_mm256_add_ps(t[0], t[2]), _mm256_add_ps(t[1], t[3]));
    const __m256 v = _mm256_add_ps(u, _mm256_permute_ps(u, 0xB1));  // + the pair's other lane
    dots[h] = _mm256_castps256_ps128(
        _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
  }
  const __m256 all = _mm256_set_m128(dots[1], dots[0]);
  return _mm256_add_ps(_mm256_add_ps(all, _mm256_setzero_ps()), acc.mins);
}

// out[r * N + 0..7] = activation row m0 + r (r < R) against the group at `group` (nb x8
// super-blocks of F), as q8_kquant_x8.h's x8_dot. (Rows 0-3 over all super-blocks, then 4-7,
// was slower: 1.2x on a Q6_K [2048, 8192] at one row.) A tile of more than F::kMaxTileRows
// activation rows goes as smaller tiles: a row's bits do not depend on its tile.
template <typename F, int R>
void x8_dot(const uint8_t* group, const Q8Acts& a, int64_t m0, float* out, int64_t N) {
  if constexpr (R > F::kMaxTileRows) {
    constexpr int kFirst = F::kMaxTileRows;
    x8_dot<F, kFirst>(group, a, m0, out, N);
    x8_dot<F, R - kFirst>(group, a, m0 + kFirst, out + kFirst * N, N);
    return;
  }
  Y8Acc acc[R];
  for (int r = 0; r < R; ++r) {
    for (Y8Half& half : acc[r].half)
      for (int s = 0; s < 2; ++s)
        for (int c = 0; c < 4; ++c) half.sets[s][c] = _mm256_setzero_ps();
    acc[r].mins = _mm256_setzero_ps();
  }
  x8_blocks<R>(group, F::kBytes, a, m0, [&](int64_t b, auto set, const X8Rows<R>& rows) {
    F::template block<decltype(set)::value, R>(group + b * F::kBytes, rows, acc);
  });
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N, y8_finish(acc[r]));
}

template <bool kFifthBit>  // Q5_K: Q4_K's nibbles with bit u of qh as unit u's fifth bit
struct K4Y8 {
  static constexpr int64_t kBytes = 8 * (kFifthBit ? 176 : 144);
  static constexpr int kMaxTileRows = 4;  // q8_matmul.cpp's whole tile: one c's R sums live
  // Row r's sum over units of min[r][u] * (bsum[2u] + bsum[2u + 1]), exact, in lane r.
  static inline __attribute__((always_inline)) __m256i min_sums(__m256i mn_lo, __m256i mn_hi,
                                                                const int16_t* bsums) {
    const __m256i units = _mm256_madd_epi16(y8_load(reinterpret_cast<const uint8_t*>(bsums)),
                                            _mm256_set1_epi16(1));
    const __m256i words = _mm256_packs_epi32(units, units);  // |sum| <= 4064: units 0-3 | 4-7, twice
    const __m256i lo = _mm256_permute2x128_si256(words, words, 0x00);
    const __m256i hi = _mm256_permute2x128_si256(words, words, 0x11);
    __m256i half[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i m_lo = _mm256_cvtepu8_epi16(y8_half_bytes(mn_lo, h));
      const __m256i m_hi = _mm256_cvtepu8_epi16(y8_half_bytes(mn_hi, h));
      half[h] = _mm256_add_epi32(_mm256_madd_epi16(m_lo, lo), _mm256_madd_epi16(m_hi, hi));
    }
    return y8_pair_sums(half[0], half[1]);
  }
  template <int S, int R>
  static inline __attribute__((always_inline)) void block(const uint8_t* sb, const X8Rows<R>& x,
                                                          Y8Acc* acc) {
    __m256i sc_lo, sc_hi, mn_lo, mn_hi;
    k4x8_scales(sb, sc_lo, sc_hi, mn_lo, mn_hi);
    for (int h = 0; h < 2; ++h) half_ints<R>(sb, h, sc_lo, sc_hi, x, acc);
    const __m256 d = y8_halves(sb), dmin = y8_halves(sb + 16);
    for (int r = 0; r < R; ++r) {  // each of d, dmin times d_x rounded once (as `prod`)
      const __m256 dd = fopaque(_mm256_mul_ps(d, _mm256_set1_ps(x.dx[r])));
      const __m256 dm = fopaque(_mm256_mul_ps(dmin, _mm256_set1_ps(x.dx[r])));
      y8_scale_ints<S>(acc[r], dd);
      const __m256i msum = min_sums(mn_lo, mn_hi, x.bsums[r]);
      acc[r].mins = _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(msum), acc[r].mins);
    }
  }
  // Half h's integer lanes of one super-block (rows 4h .. 4h + 3), for each activation row.
  template <int R>
  static inline __attribute__((always_inline)) void half_ints(const uint8_t* sb, int h,
                                                              __m256i sc_lo, __m256i sc_hi,
                                                              const X8Rows<R>& x, Y8Acc* acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i words_lo = _mm256_cvtepu8_epi16(y8_half_bytes(sc_lo, h));
    const __m256i words_hi = _mm256_cvtepu8_epi16(y8_half_bytes(sc_hi, h));
    __m256i scales[8];  // unit u's scales (4 rows)
    for (int u = 0; u < 8; ++u) scales[u] = y8_spread(u < 4 ? words_lo : words_hi, u % 4);
    // c outermost: R accumulators live at a time (the sums are exact in any order)
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      __m256i ints[R];
      for (int r = 0; r < R; ++r) ints[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = y8_load(sb + 128 + 256 * p + 64 * c + 32 * h);
        __m256i low = _mm256_and_si256(raw, nibble);
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        if constexpr (kFifthBit) {  // bits 2p and 2p + 1 of qh[8c .. 8c + 7], 4 rows
          const __m256i qh = y8_load(sb + 1152 + 64 * c + 32 * h);
          low = or_shifted(low, _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4);
          high = or_shifted(high, _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4);
        }
        for (int r = 0; r < R; ++r) {
          ints[r] = dot_scaled(ints[r], low, y8_codes(x.xq[r] + 64 * p + 8 * c), scales[2 * p]);
          ints[r] = dot_scaled(ints[r], high, y8_codes(x.xq[r] + 64 * p + 32 + 8 * c),
                               scales[2 * p + 1]);
        }
      }
      for (int r = 0; r < R; ++r) acc[r].half[h].ints[c] = ints[r];
    }
  }
};

using Q4KX8 = K4Y8<false>;
using Q5KX8 = K4Y8<true>;

struct Q6KX8 {
  static constexpr int64_t kBytes = 8 * 210;
  // Two activation rows at a time: half_ints keeps R x 4 integer sums live, and at 4 rows
  // those 16 fill every ymm register (spilled: 1.23x slower at 16-256 rows on a Zen 3; one
  // row at a time was slower still, the codes built once per row)
  static constexpr int kMaxTileRows = 2;
  // Bits 2s, 2s + 1 of each byte of qh as bits 4, 5 (one shift and one mask: 16-bit shifts,
  // whatever crosses from the neighbouring byte lands outside the mask).
  static inline __m256i q6_high_bits(__m256i qh, int s) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    if (s == 0) return _mm256_and_si256(_mm256_slli_epi16(qh, 4), mask);
    if (s == 1) return _mm256_and_si256(_mm256_slli_epi16(qh, 2), mask);
    if (s == 2) return _mm256_and_si256(qh, mask);
    return _mm256_and_si256(_mm256_srli_epi16(qh, 2), mask);
  }
  template <int S, int R>
  static inline __attribute__((always_inline)) void block(const uint8_t* sb, const X8Rows<R>& x,
                                                          Y8Acc* acc) {
    for (int h = 0; h < 2; ++h) half_ints<R>(sb, h, x, acc);
    const __m256 d = y8_halves(sb);
    for (int r = 0; r < R; ++r) {
      const __m256 dd = fopaque(_mm256_mul_ps(d, _mm256_set1_ps(x.dx[r])));
      y8_scale_ints<S>(acc[r], dd);
      const __m256i msum = _mm256_slli_epi32(scale_sums(sb, x.bsums[r]), 5);
      acc[r].mins = _mm256_fnmadd_ps(dd, _mm256_cvtepi32_ps(msum), acc[r].mins);
    }
  }
  // Half h's integer lanes of one super-block (rows 4h .. 4h + 3), for each activation row.
  template <int R>
  static inline __attribute__((always_inline)) void half_ints(const uint8_t* sb, int h,
                                                              const X8Rows<R>& x, Y8Acc* acc) {
    // scales as int16: word 4r + i of words[z] is row 4h + r's scale 4z + i
    __m256i words[4];
    for (int z = 0; z < 4; ++z)
      words[z] = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 + 32 * z + 16 * h)));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i ints[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) ints[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const uint8_t* part = sb + 144 + 192 * (4 * q + c) + 32 * h;
        const __m256i ql[2] = {y8_load(part), y8_load(part + 64)};
        const __m256i qh = y8_load(part + 128);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {  // unit 4q + s: nibble s / 2 of ql[s % 2]
          const int u = 4 * q + s, k = 2 * u + c / 2;  // the scale of codes 8c .. 8c + 7
          const __m256i low =
              _mm256_and_si256(s < 2 ? ql[s] : _mm256_srli_epi16(ql[s - 2], 4), nibble);
          const __m256i codes = _mm256_or_si256(low, q6_high_bits(qh, s));
          const __m256i scale = y8_spread(words[k / 4], k % 4);
          for (int r = 0; r < R; ++r)
            ints[r][c] = dot_scaled(ints[r][c], codes, y8_codes(x.xq[r] + 32 * u + 8 * c), scale);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r].half[h].ints[c] = ints[r][c];
  }
  // Row r's sum_k scale[k] bsum[k], exact, in lane r: bsums 4z .. 4z + 3 against the scales.
  static inline __attribute__((always_inline)) __m256i scale_sums(const uint8_t* sb,
                                                                  const int16_t* bsums) {
    __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int z = 0; z < 4; ++z) {
      int64_t four;
      std::memcpy(&four, bsums + 4 * z, sizeof(four));
      const __m256i b = _mm256_set1_epi64x(four);
      for (int h = 0; h < 2; ++h) {
        const __m256i words = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 + 32 * z + 16 * h)));
        half[h] = _mm256_add_epi32(half[h], _mm256_madd_epi16(words, b));
      }
    }
    return y8_pair_sums(half[0], half[1]);
  }
};
#endif

}  // namespace radixserve_q8
