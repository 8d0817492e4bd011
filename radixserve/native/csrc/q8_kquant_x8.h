// Q4_K, Q5_K and Q6_K weights 8 rows at a time for the AVX-512 int8-activation matmul: the scale /
// min unpacking, the min sums and the fp32 steps of a super-block are then vector work shared
// by 8 output rows, where the row layout (q8_formats.h's Q4KRows / Q6KRows) does them per row.
// The idea of llama.cpp's repacked `block_q4_Kx8` (our own byte order, and Q6_K too).
//
// kquant_blocks.h has the repacked layouts (type ids kQ4KX8, kQ5KX8, kQ6KX8); one 64-byte
// load holds codes 8c .. 8c + 7 of a unit for all 8 rows, against 8 activation codes
// broadcast to every row; a super-block's bytes lie in the order the kernel reads them, and
// while a group's super-block is decoded the same super-block of the next group is asked for
// (x8_dot: one group ahead, by the first tile of activation rows only). The hardware
// prefetchers alone left one core at ~17-20 GB/s on an AMD EPYC (family 26) where this reads
// 30-34 (one row; 4 rows 2x faster); two groups ahead was no better. (An earlier layout and
// `prefetchnta` four super-blocks ahead were slower: docs/performance.md.)
//
// Bits: each row's integer lanes (codes 4j .. 4j + 3 of every unit, times their scale, summed
// over units: lane j), its fp32 lane sets (super-block b into set b % 2), min / offset terms
// and final reduction are those of the row kernels on every SIMD level, so a repacked weight
// gives the same bits as the row layout, at any number of rows: the tests compare them.
// AVX2 builds run q8_kquant_x8_ymm.h's kernels (the same layout, four rows per vector); the
// portable build unpacks the repacked bytes group by group for the row kernels
// (kquant_blocks.h's for_rows_unpacked).
#pragma once

#include "q8_formats.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixserve_q8 {

// One super-block's activation rows m0 .. m0 + R - 1: codes, d_x, sums per 16.
template <int R>
struct X8Rows {
  const int8_t* xq[R];
  float dx[R];
  const int16_t* bsums[R];
};

constexpr int64_t kX8Ahead = 1;  // groups ahead whose bytes are asked for (see the top)

// The super-blocks of a group (`bytes` each), two at a time into lane sets 0 and 1 (an odd
// last one into set 0): fn(b, set, rows) with activation rows m0 .. m0 + R - 1 of super-block
// b. The first tile of rows (m0 == 0) asks for the next group's bytes as it goes.
template <int R, typename Fn>
inline void x8_blocks(const uint8_t* group, int64_t bytes, const Q8Acts& a, int64_t m0, Fn&& fn) {
  const int64_t nb = a.num_blocks;
  // past the last group this points beyond the weights: a prefetch never faults
  const uint8_t* next = m0 == 0 ? group + kX8Ahead * nb * bytes : nullptr;
  auto block = [&](int64_t b, auto set) {
    if (next != nullptr) prefetch(next + b * bytes, bytes);
    X8Rows<R> rows;
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (m0 + r) * nb + b;
      rows.xq[r] = a.qs + (m0 + r) * a.K + b * kQ8KBlock;
      rows.dx[r] = a.d[ab];
      rows.bsums[r] = a.bsums + ab * 16;
    }
    fn(b, set, rows);
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, std::integral_constant<int, 0>{});
    block(b + 1, std::integral_constant<int, 1>{});
  }
  if (b < nb) block(b, std::integral_constant<int, 0>{});
}

#if defined(__AVX2__)
// The 8 rows' Q4_K / Q5_K scales (units 0-3, 4-7) and mins as bytes 4r + k, from the 3 words
// per row of an x8 super-block (kquant_blocks.h's unpack_scales_k4, 8 rows in one go).
inline void k4x8_scales(const uint8_t* sb, __m256i& sc_lo, __m256i& sc_hi, __m256i& mn_lo,
                        __m256i& mn_hi) {
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64));
  const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 96));
  const __m256i m6 = _mm256_set1_epi32(0x3F3F3F3F), m4 = _mm256_set1_epi32(0x0F0F0F0F);
  const __m256i m2 = _mm256_set1_epi32(0x03030303);
  sc_lo = _mm256_and_si256(q0, m6);
  mn_lo = _mm256_and_si256(q1, m6);
  sc_hi = _mm256_or_si256(_mm256_and_si256(q2, m4),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q0, 6), m2), 4));
  mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(q2, 4), m4),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q1, 6), m2), 4));
}

// The 16-byte shuffle of x8_spread / y8_spread: in each 128-bit lane (two rows' 4 words
// each), word 4r + i = word 4r + k.
inline __m128i spread_pattern(int k) {
  return _mm_setr_epi8(2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1,
                       8 + 2 * k, 9 + 2 * k, 8 + 2 * k, 9 + 2 * k, 8 + 2 * k, 9 + 2 * k,
                       8 + 2 * k, 9 + 2 * k);
}
#endif

#if defined(RADIXSERVE_Q8_ZMM)
// The 8 rows' state: integer lanes of the current super-block (row r's lanes 2c, 2c + 1 at
// 2r, 2r + 1 of ints[c]), the fp32 lane sets likewise, the min / offset terms per row.
struct X8Acc {
  __m512i ints[4];
  __m512 sets[2][4];
  __m256 mins;
};

// 8 activation codes at xq, in every row's 8 bytes.
inline __m512i x8_codes(const int8_t* xq) {
  int64_t v;
  std::memcpy(&v, xq, sizeof(v));
  return _mm512_set1_epi64(v);
}

// Set S += (d_r d_x) * the integer lanes, row by row; `dd` the 8 rows' d_r d_x.
template <int S>
inline void x8_scale_ints(X8Acc& acc, __m256 dd) {
  const __m512 dd2 = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(dd));
  for (int c = 0; c < 4; ++c)
    acc.sets[S][c] = _mm512_fmadd_ps(dd2, _mm512_cvtepi32_ps(acc.ints[c]), acc.sets[S][c]);
}

// The 8 rows' results: dsum's order per row, then + the offsets' sums (Int4; 0 for the
// K-quants) + the min terms (the K-quants; 0 for Int4), as dot_rows adds them.
inline __m256 x8_finish(const X8Acc& acc, __m256 offsets) {
  __m512 t[4];
  for (int c = 0; c < 4; ++c) t[c] = _mm512_add_ps(acc.sets[0][c], acc.sets[1][c]);
  const __m512 u = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));  // + the pair's other lane
  const __m256 dots = _mm512_castps512_ps256(_mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), v));
  return _mm256_add_ps(_mm256_add_ps(dots, offsets), acc.mins);
}

// out[r * N + 0..7] = activation row m0 + r (r < R) against the group at `group` (nb x8
// super-blocks of F): each block's codes decoded once for the R rows.
template <typename F, int R>
void x8_dot(const uint8_t* group, const Q8Acts& a, int64_t m0, float* out, int64_t N) {
  X8Acc acc[R];
  for (int r = 0; r < R; ++r) {
    for (int s = 0; s < 2; ++s)
      for (int c = 0; c < 4; ++c) acc[r].sets[s][c] = _mm512_setzero_ps();
    acc[r].mins = _mm256_setzero_ps();
  }
  x8_blocks<R>(group, F::kBytes, a, m0, [&](int64_t b, auto set, const X8Rows<R>& rows) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r].ints[c] = _mm512_setzero_si512();
    F::template block<decltype(set)::value, R>(group + b * F::kBytes, rows, acc);
  });
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(out + r * N, x8_finish(acc[r], _mm256_setzero_ps()));
}

// Word 4r + i of the result = word 4r + k of `words` (row r's k-th scale, 4 copies): an
// in-lane byte shuffle, each 128-bit lane holding two rows.
inline __m512i x8_spread(__m512i words, int k) {
  return _mm512_shuffle_epi8(words, _mm512_broadcast_i32x4(spread_pattern(k)));
}

template <bool kFifthBit>  // Q5_K: Q4_K's nibbles with bit u of qh as unit u's fifth bit
struct K4X8 {
  static constexpr int64_t kBytes = 8 * (kFifthBit ? 176 : 144);
  // Row r's sum over units of min[r][u] * (bsum[2u] + bsum[2u + 1]), exact, as 8 int32.
  static __m256i min_sums(__m256i mn_lo, __m256i mn_hi, const int16_t* bsums) {
    const __m256i pairs = _mm256_madd_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), _mm256_set1_epi16(1));
    const __m128i words = _mm256_cvtepi32_epi16(pairs);  // |sum| <= 4064
    const __m512i lo = _mm512_broadcastq_epi64(words);
    const __m512i hi = _mm512_broadcastq_epi64(_mm_unpackhi_epi64(words, words));
    const __m512i prod = _mm512_add_epi32(_mm512_madd_epi16(_mm512_cvtepu8_epi16(mn_lo), lo),
                                          _mm512_madd_epi16(_mm512_cvtepu8_epi16(mn_hi), hi));
    return _mm512_cvtepi64_epi32(_mm512_add_epi64(prod, _mm512_srli_epi64(prod, 32)));
  }
  template <int S, int R>
  static void block(const uint8_t* sb, const X8Rows<R>& x, X8Acc* acc) {
    __m256i sc_lo, sc_hi, mn_lo, mn_hi;
    k4x8_scales(sb, sc_lo, sc_hi, mn_lo, mn_hi);
    const __m512i words_lo = _mm512_cvtepu8_epi16(sc_lo), words_hi = _mm512_cvtepu8_epi16(sc_hi);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i words = p < 2 ? words_lo : words_hi;
      const __m512i scale_a = x8_spread(words, (2 * p) % 4);  // unit 2p's scales
      const __m512i scale_b = x8_spread(words, (2 * p + 1) % 4);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(sb + 128 + 256 * p + 64 * c);
        __m512i low = _mm512_and_si512(raw, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        if constexpr (kFifthBit) {  // bits 2p and 2p + 1 of qh[8c .. 8c + 7], every row
          const __m512i qh = _mm512_loadu_si512(sb + 1152 + 64 * c), one = _mm512_set1_epi8(1);
          low = zor_shifted(low, _mm512_and_si512(_mm512_srli_epi16(qh, 2 * p), one), 4);
          high = zor_shifted(high, _mm512_and_si512(_mm512_srli_epi16(qh, 2 * p + 1), one), 4);
        }
        for (int r = 0; r < R; ++r) {
          __m512i& ints = acc[r].ints[c];
          ints = zdot_scaled(ints, low, x8_codes(x.xq[r] + 64 * p + 8 * c), scale_a);
          ints = zdot_scaled(ints, high, x8_codes(x.xq[r] + 64 * p + 32 + 8 * c), scale_b);
        }
      }
    }
    // d in lanes 0-7, dmin in 8-15; each times d_x rounded once (as `prod`)
    const __m512 halves = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    for (int r = 0; r < R; ++r) {
      const __m512 both = _mm512_mul_ps(halves, _mm512_set1_ps(x.dx[r]));
      const __m256 dd = fopaque(_mm512_castps512_ps256(both));
      const __m256 dm = fopaque(_mm512_extractf32x8_ps(both, 1));
      x8_scale_ints<S>(acc[r], dd);
      const __m256i msum = min_sums(mn_lo, mn_hi, x.bsums[r]);
      acc[r].mins = _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(msum), acc[r].mins);
    }
  }
};

using Q4KX8 = K4X8<false>;
using Q5KX8 = K4X8<true>;

struct Q6KX8 {
  static constexpr int64_t kBytes = 8 * 210;
  template <int S, int R>
  static void block(const uint8_t* sb, const X8Rows<R>& x, X8Acc* acc) {
    // scales as int16: word 4r + i of words[z] is row r's scale 4z + i
    __m512i words[4];
    for (int z = 0; z < 4; ++z)
      words[z] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * z)));
    const __m512i nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const uint8_t* part = sb + 144 + 192 * (4 * h + c);
        const __m512i ql[2] = {_mm512_loadu_si512(part), _mm512_loadu_si512(part + 64)};
        const __m512i qh = _mm512_loadu_si512(part + 128);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {  // unit 4h + s: nibble s / 2 of ql[s % 2]
          const int u = 4 * h + s, k = 2 * u + c / 2;  // the scale of codes 8c .. 8c + 7
          const __m512i low = _mm512_and_si512(s < 2 ? ql[s] : _mm512_srli_epi16(ql[s - 2], 4), nibble);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * s), two);
          const __m512i codes = zor_shifted(low, high, 4);
          const __m512i scale = x8_spread(words[k / 4], k % 4);
          for (int r = 0; r < R; ++r)
            acc[r].ints[c] = zdot_scaled(acc[r].ints[c], codes, x8_codes(x.xq[r] + 32 * u + 8 * c),
                                         scale);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb))));
    for (int r = 0; r < R; ++r) {
      const __m256 dd = fopaque(_mm256_mul_ps(_mm512_castps512_ps256(d), _mm256_set1_ps(x.dx[r])));
      x8_scale_ints<S>(acc[r], dd);
      const __m256i msum = _mm256_slli_epi32(scale_sums(words, x.bsums[r]), 5);
      acc[r].mins = _mm256_fnmadd_ps(dd, _mm256_cvtepi32_ps(msum), acc[r].mins);
    }
  }
  // Row r's sum_k scale[k] bsum[k], exact: bsums 4z .. 4z + 3 against words[z].
  static __m256i scale_sums(const __m512i* words, const int16_t* bsums) {
    __m512i sums = _mm512_setzero_si512();
    for (int z = 0; z < 4; ++z) {
      int64_t four;
      std::memcpy(&four, bsums + 4 * z, sizeof(four));
      sums = _mm512_add_epi32(sums, _mm512_madd_epi16(words[z], _mm512_set1_epi64(four)));
    }
    return _mm512_cvtepi64_epi32(_mm512_add_epi64(sums, _mm512_srli_epi64(sums, 32)));
  }
};
#endif

}  // namespace radixserve_q8
