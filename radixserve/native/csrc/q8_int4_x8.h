// Q4_0 / Q4_1 weights 8 rows at a time for the AVX-512 / AVX2 int8-activation matmul, the idea of
// llama.cpp's q4_0_8x8 (our own byte order): one 64-byte load holds 8 nibble bytes of a block
// for all 8 rows, the 8 rows' scales are one fp16 vector, their offsets 8-row vectors; and the
// scales are fp16 again, as the file has them (the row layout keeps fp32 pairs: 24 bytes a
// block and row, here 18 / 20 as in the GGUF file).
//
// Layout (ggml's type id + kX8Type: kQ40X8, kQ41X8); the tensor keeps its rows: [N, K / 32 *
// B], B = 18 (Q4_0: offset m = -8 d, not stored) or 20 (Q4_1). Rows 8g .. 8g + 7 (a group)
// are chunks of up to 4 blocks; chunk c (blocks 4c .. 4c + n - 1) at byte 4c * 8 * B:
//
//   d[n][8] f16 | (Q4_1) m[n][8] f16 | for j < n: nibble bytes 0-7 of block 4c + j of row r
//   at 8r (64 B), bytes 8-15 likewise (64 B)
//
// so that a full chunk's codes start on a 64-byte line. Rows past the last group lie per row
// and block as d f16 | (Q4_1) m f16 | 16 nibble bytes (GGUF's own block order).
//
// Bits: each row's block sums (exact integers), its fp32 steps per block (into lane b % 8:
// fma(d_w d_x, sum, acc) + m_w d_x sum q_x, each product rounded once) and the final reduction
// are q8_formats.h's Int4Rows', and an fp16 scale is the fp32 value the row layout holds, so a
// repacked weight gives the row layout's bits at any number of rows: the tests compare them.
// On portable builds (and for the rows past the last group) the bytes are unpacked to the row
// layout for Int4Rows (for_int4_rows_unpacked).
#pragma once

#include "kquant_blocks.h"
#include "q8_kquant_x8_ymm.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixserve_q8 {

constexpr int64_t kQ40X8 = 2 + radixserve_kquant::kX8Type, kQ41X8 = 3 + radixserve_kquant::kX8Type;
constexpr int64_t kX8Chunk = 4;  // blocks per chunk of a group

// Where the parts of row r's block b lie (byte offsets), in a group or in a row past them.
struct Int4X8At {
  int64_t d, m, lo, hi;  // the fp16 scale, the fp16 offset (Q4_1), nibble bytes 0-7, 8-15
};

struct Int4X8Layout {
  bool has_min;  // Q4_1
  int64_t nb;    // blocks per row
  int64_t block_bytes() const { return has_min ? 20 : 18; }
  int64_t row_bytes() const { return nb * block_bytes(); }
  Int4X8At in_group(int64_t r, int64_t b) const {
    const int64_t c = b / kX8Chunk, j = b % kX8Chunk, n = std::min(kX8Chunk, nb - kX8Chunk * c);
    const int64_t base = kX8Chunk * c * radixserve_kquant::kX8Rows * block_bytes();
    const int64_t codes = base + (has_min ? 32 : 16) * n + 128 * j + 8 * r;
    return {base + 16 * j + 2 * r, base + 16 * n + 16 * j + 2 * r, codes, codes + 64};
  }
  Int4X8At in_row(int64_t b) const {
    const int64_t base = b * block_bytes(), codes = base + (has_min ? 4 : 2);
    return {base, base + 2, codes, codes + 8};
  }
  // Row n's block b in weights `w` of N rows.
  Int4X8At at(int64_t N, int64_t n, int64_t b, int64_t& base) const {
    const int64_t rows = radixserve_kquant::kX8Rows, grouped = N / rows * rows;
    base = (n < grouped ? n / rows * rows : n) * row_bytes();
    return n < grouped ? in_group(n % rows, b) : in_row(b);
  }
};

inline uint16_t half_bits(float v) { return c10::Half(v).x; }
using radixserve_kquant::half_at;

// Row layout (qs [N, nb * 16], scale_min [N, nb, 2] fp32) -> repacked rows [n0, n1) of `w`.
inline void repack_int4_rows(const uint8_t* qs, const float* sm, const Int4X8Layout& L, int64_t N,
                             int64_t n0, int64_t n1, uint8_t* w) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < L.nb; ++b) {
      int64_t base;
      const Int4X8At at = L.at(N, n, b, base);
      const float* pair = sm + 2 * (n * L.nb + b);
      const uint16_t d = half_bits(pair[0]), m = half_bits(pair[1]);
      std::memcpy(w + base + at.d, &d, 2);
      if (L.has_min) std::memcpy(w + base + at.m, &m, 2);
      std::memcpy(w + base + at.lo, qs + (n * L.nb + b) * 16, 8);
      std::memcpy(w + base + at.hi, qs + (n * L.nb + b) * 16 + 8, 8);
    }
}

// Rows rows[0 .. count) of repacked `w` -> the row layout, row i into qs / sm row i.
inline void unpack_int4_rows(const uint8_t* w, const Int4X8Layout& L, int64_t N,
                             const int64_t* rows, int64_t count, uint8_t* qs, float* sm) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t b = 0; b < L.nb; ++b) {
      int64_t base;
      const Int4X8At at = L.at(N, rows[i], b, base);
      const float d = half_at(w + base + at.d);
      float* pair = sm + 2 * (i * L.nb + b);
      pair[0] = d;
      pair[1] = L.has_min ? half_at(w + base + at.m) : 0.f - 8.f * d;  // as the loader's
      std::memcpy(qs + (i * L.nb + b) * 16, w + base + at.lo, 8);
      std::memcpy(qs + (i * L.nb + b) * 16 + 8, w + base + at.hi, 8);
    }
}

// fn(qs, scale_min, first, count) over weight rows [n0, n1) of repacked `w`, 8 rows at a time
// unpacked to the row layout: the row kernels' way onto the repacked bytes.
template <typename Fn>
void for_int4_rows_unpacked(const uint8_t* w, const Int4X8Layout& L, int64_t N, int64_t n0,
                            int64_t n1, Fn&& fn) {
  const int64_t step = radixserve_kquant::kX8Rows;
  std::vector<uint8_t> qs(step * L.nb * 16);
  std::vector<float> sm(step * L.nb * 2);
  int64_t rows[step];
  for (int64_t first = n0; first < n1; first += step) {
    const int64_t count = std::min(step, n1 - first);
    for (int64_t i = 0; i < count; ++i) rows[i] = first + i;
    unpack_int4_rows(w, L, N, rows, count, qs.data(), sm.data());
    fn(qs.data(), sm.data(), first, count);
  }
}

// fn(b0, n, chunk, codes) over the chunks of a group (blocks b0 .. b0 + n - 1; `chunk` its
// bytes, `codes` where its nibble bytes start). The first tile of rows (m0 == 0) asks for the
// next group's bytes as it goes, as x8_dot does.
template <bool kMin, typename Fn>
inline void int4_x8_chunks(const uint8_t* group, const Q8Acts& a, int64_t m0, Fn&& fn) {
  const int64_t nb = a.num_blocks, bytes = kMin ? 20 : 18;
  const int64_t group_bytes = radixserve_kquant::kX8Rows * nb * bytes;
  const uint8_t* next = m0 == 0 ? group + kX8Ahead * group_bytes : nullptr;
  for (int64_t b0 = 0; b0 < nb; b0 += kX8Chunk) {
    const int64_t n = std::min(kX8Chunk, nb - b0);
    const uint8_t* chunk = group + b0 * radixserve_kquant::kX8Rows * bytes;
    if (next != nullptr) {
      prefetch(next + (chunk - group), n * radixserve_kquant::kX8Rows * bytes);
    }
    fn(b0, n, chunk, chunk + (kMin ? 32 : 16) * n);
  }
}

#if defined(RADIXSERVE_Q8_ZMM)
inline __m512 zopaque(__m512 v) {  // a product rounded once, never fused into an add
  __asm__("" : "+v"(v));
  return v;
}

// The fp16 words of up to two blocks (8 each) at p as 16 fp32 lanes; blocks past n: 0.
inline __m512 x8_halves(const uint8_t* p, int64_t n) {
  if (n <= 0) return _mm512_setzero_ps();
  const __mmask16 mask = n >= 2 ? 0xFFFF : 0x00FF;
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// Lanes 0-7 = v[i], lanes 8-15 = v[j].
inline __m512 x8_split(__m512 v, int i, int j) {
  return _mm512_permutexvar_ps(
      _mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(j), 1), v);
}

// Integer lanes of 8 codes (xq) against 8 codes of each row (w): row r's at lanes 2r, 2r + 1.
inline __m512i x8_dot_acc(__m512i acc, __m512i w, const int8_t* xq) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, x8_codes(xq));
#else
  return _mm512_add_epi32(acc, dual_dot_us(w, x8_codes(xq)));
#endif
}

// out[r * N + 0..7] = activation row m0 + r (r < R) against the group at `group`: each
// block's codes decoded once for the R rows. kMin: Q4_1. Row r's block sums go as Int4Rows
// adds them: block b into lane b % 8 (here lanes 0-7 of acc[r][(b % 8) / 2] for even b, lanes
// 8-15 for odd b, row i at lane i), fma(d_w d_x, sum, acc) + m_w d_x sum q_x.
template <bool kMin, int R>
void int4_x8_dot(const uint8_t* group, const Q8Acts& a, int64_t m0, float* out, int64_t N) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t nb = a.num_blocks;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // row i's even / odd lanes of two blocks' sums -> [block 0 rows 0-7 | block 1 rows 0-7]
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  int4_x8_chunks<kMin>(group, a, m0, [&](int64_t b0, int64_t n, const uint8_t* chunk,
                                         const uint8_t* codes) {
    for (int h = 0; 2 * h < n; ++h) {  // blocks j = 2h, 2h + 1 of the chunk (the second may not be)
      const int64_t blocks = std::min<int64_t>(2, n - 2 * h);
      const __m512 d = x8_halves(chunk + 32 * h, blocks);
      const __m512 m = kMin ? x8_halves(chunk + 16 * n + 32 * h, blocks)
                            : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_set1_ps(8.f), d));
      __m512i w[2][4];
      for (int e = 0; e < blocks; ++e) {
        const __m512i lo = _mm512_loadu_si512(codes + 128 * (2 * h + e));
        const __m512i hi = _mm512_loadu_si512(codes + 128 * (2 * h + e) + 64);
        w[e][0] = _mm512_and_si512(lo, nibble);
        w[e][1] = _mm512_and_si512(hi, nibble);
        w[e][2] = _mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble);
        w[e][3] = _mm512_and_si512(_mm512_srli_epi16(hi, 4), nibble);
      }
      const int slot = static_cast<int>((b0 % 8) / 2 + h);
      for (int r = 0; r < R; ++r) {
        const int64_t b = b0 + 2 * h;
        __m512i ints[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int e = 0; e < blocks; ++e) {
          const int8_t* xq = a.qs + (m0 + r) * a.K + (b + e) * kQ8Block;
          for (int c = 0; c < 4; ++c) ints[e] = x8_dot_acc(ints[e], w[e][c], xq + 8 * c);
        }
        const __m512i sums = _mm512_add_epi32(_mm512_permutex2var_epi32(ints[0], even, ints[1]),
                                              _mm512_permutex2var_epi32(ints[0], odd, ints[1]));
        // (d_x, d_x sum q_x) of the two blocks, 0 past the chunk
        const __mmask16 mask = static_cast<__mmask16>((1u << (2 * blocks)) - 1);
        const __m512 p = _mm512_maskz_loadu_ps(mask, a.pairs + 2 * ((m0 + r) * nb + b));
        const __m512 dd = zopaque(_mm512_mul_ps(d, x8_split(p, 0, 2)));
        const __m512 off = zopaque(_mm512_mul_ps(m, x8_split(p, 1, 3)));
        acc[r][slot] = _mm512_add_ps(_mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sums), acc[r][slot]), off);
      }
    }
  });
  const X8Acc zero{};
  for (int r = 0; r < R; ++r) {  // ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): odd_sum's
    __m256 pair[4];
    for (int i = 0; i < 4; ++i)
      pair[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][i]), _mm512_extractf32x8_ps(acc[r][i], 1));
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(pair[0], pair[1]), _mm256_add_ps(pair[2], pair[3]));
    _mm256_storeu_ps(out + r * N, x8_finish(zero, sum));  // (0 + sum) + 0, as dot_rows
  }
}
#endif

#if defined(RADIXSERVE_Q8_YMM)
// AVX2: the same steps on 8-lane vectors, a block at a time. Each 64-byte part of a block (8
// rows' nibble bytes) is two 32-byte halves, rows 0-3 and rows 4-7; row i's block sum lands in
// lane i (y8_pair_sums), so acc[r][b % 8] holds block slot b % 8 of the 8 rows, the lane
// Int4Rows gives it, and the fp32 steps and the final order are the AVX-512 kernel's.
template <bool kMin, int R>
void int4_x8_dot(const uint8_t* group, const Q8Acts& a, int64_t m0, float* out, int64_t N) {
  __m256 acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t nb = a.num_blocks;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  int4_x8_chunks<kMin>(group, a, m0, [&](int64_t b0, int64_t n, const uint8_t* chunk,
                                         const uint8_t* codes) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      const __m256 d = y8_halves(chunk + 16 * j);
      const __m256 m = kMin ? y8_halves(chunk + 16 * n + 16 * j)
                            : _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(8.f), d));
      __m256i w[2][4];  // [rows 0-3, 4-7][codes 8c .. 8c + 7 of each row]
      for (int h = 0; h < 2; ++h) {
        const __m256i lo = y8_load(codes + 128 * j + 32 * h);
        const __m256i hi = y8_load(codes + 128 * j + 64 + 32 * h);
        w[h][0] = _mm256_and_si256(lo, nibble);
        w[h][1] = _mm256_and_si256(hi, nibble);
        w[h][2] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble);
        w[h][3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.qs + (m0 + r) * a.K + b * kQ8Block;
        __m256i ints[2] = {izero(), izero()};
        for (int c = 0; c < 4; ++c) {
          const __m256i x = y8_codes(xq + 8 * c);
          for (int h = 0; h < 2; ++h) ints[h] = dot_us(ints[h], w[h][c], x);
        }
        const __m256i sums = y8_pair_sums(ints[0], ints[1]);  // exact
        const float* p = a.pairs + 2 * ((m0 + r) * nb + b);  // d_x, d_x sum q_x
        const __m256 dd = fopaque(_mm256_mul_ps(d, _mm256_set1_ps(p[0])));
        const __m256 off = fopaque(_mm256_mul_ps(m, _mm256_set1_ps(p[1])));
        __m256& slot = acc[r][b % 8];
        slot = _mm256_add_ps(_mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sums), slot), off);
      }
    }
  });
  for (int r = 0; r < R; ++r) {  // ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): odd_sum's
    const __m256* s = acc[r];
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                                     _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7])));
    _mm256_storeu_ps(out + r * N, _mm256_add_ps(_mm256_add_ps(_mm256_setzero_ps(), sum),
                                                _mm256_setzero_ps()));  // (0 + sum) + 0, as dot_rows
  }
}
#endif

}  // namespace radixserve_q8
