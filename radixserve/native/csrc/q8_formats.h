// Each weight format's view for the int8-activation matmuls (q8_matmul.cpp): its weight codes
// as the unsigned / signed bytes q8_simd.h's integer dots take, and how one weight block and
// one activation block combine. The weights' bytes are the loader's, unchanged:
//
//   Int4Rows (Q4_0, Q4_1)  qs [N, K / 2] GGUF nibbles, scale_min [N, K / 32, 2]: w = q*d + m
//   Int8Rows (Q8_0)        qs [N, K] int8, scales [N, K / 32]:                   w = q*d
//   Q4K / Q5K / Q6K        super-blocks of 256 as GGUF stores them (kquant_blocks.h)
//
// Activations (`Q8Acts`) are quantized once per call, per row, as llama.cpp's q8 blocks:
// blocks of 32 (Q8_0 / Q8_1: scale d = max|x| / 127, codes round(x / d), and d * sum of the
// codes) for the 32-wide formats, blocks of 256 (Q8_K: d, and the codes' sums per 16) for the
// K-quants. A block's dot is then one integer dot and one or two fp32 fmas:
//
//   Int4:  d_w d_x * sum(q_w q_x) + m_w * (d_x sum q_x)   (each block's sum reduced first)
//   Int8:  d_w d_x * sum(q_w q_x)
//   Q4_K / Q5_K:  (d d_x) * sum_u sc_u sum(q q_x)  -  (dmin d_x) * sum_u m_u sum_u(q_x)
//   Q6_K:  (d d_x) * sum_j sc_j sum(q q_x)  -  (d d_x) * 32 sum_j sc_j sum_j(q_x)
//
// Accumulation: integer sums exact; the fp32 ones per row in block order, into two lane sets
// (even / odd block) and one scalar (the min / offset terms): a row's result never depends
// on the other rows of the call.
#pragma once

#include "common.h"
#include "kquant_blocks.h"
#include "q8_dual.h"

#include <cstdint>

namespace radixserve_q8 {

constexpr int64_t kQ8Block = 32;    // activation block of the 32-wide formats (QK8_0)
constexpr int64_t kQ8KBlock = 256;  // activation block of the K-quants (QK_K)

// One call's activations, quantized: row r, block b at [r * num_blocks + b].
struct Q8Acts {
  const int8_t* qs;      // [M, K]
  const float* d;        // [M, K / block]
  const float* pairs;    // [M, K / 32, 2]: d and d * sum of the block's codes (32-wide formats)
  const int16_t* bsums;  // [M, K / 16]: sums of 16 codes (K-quants; |sum| <= 2032)
  int64_t K;
  int64_t num_blocks;
};

// Per row of a tile: the two lane sets of the dots (even / odd block), the offsets' lanes
// (Int4) and the min terms (K-quants, one scalar chain).
struct RowAcc {
  Dual lanes;
  Pairs offsets;
  float scalar;
};

inline float prod(float a, float b) {  // a * b, never fused into a following add
  float p = a * b;
#if defined(__GNUC__) && defined(__x86_64__)
  __asm__("" : "+x"(p));
#endif
  return p;
}

using radixserve_cpu::prefetch;  // common.h

// Int4 / Int8 take their blocks 8 at a time (a group): one vector product gives the 8
// blocks' d_w d_x (and, Int4, m_w * d_x sum q_x beside each), then one fma per block (Int8: on
// the 8 lanes of its dot; Int4: on its dot's sum).
constexpr int kGroup = 8;

// Int4 sums each block's integer dot first (exact), then per block k of a group, in lane
// 2k + 1 of the row's `offsets`: acc = fma(d_w d_x, sum(q_w q_x), acc) + m_w (d_x sum q_x),
// the two products rounded once each; odd_sum then adds the 8 lanes in one fixed order. The
// lanes' integer sums may be reduced in any order (exact), so every SIMD level and the
// repacked layout (q8_int4_x8.h) give the same bits.
struct Int4Rows {
  static constexpr int64_t kBlock = kQ8Block;
  static constexpr int kBlocksPerGroup = kGroup;
  const uint8_t* qs;
  const float* scale_min;
  void prefetch_row(int64_t n, int64_t nb) const {
    prefetch(qs + n * nb * 16, nb * 16);
    prefetch(scale_min + n * nb * 2, nb * 2 * sizeof(float));
  }
  // Blocks b0 .. b0 + count - 1 (count <= kGroup; b0 a multiple of kGroup): lanes 2k, 2k + 1
  // of the products hold block k's (d_w d_x, m_w d_x sum q_x); block k's sum goes to lane
  // 2k + 1 of `offsets` (the even lanes carry values nothing reads).
  template <int64_t R>
  void group(int64_t n, int64_t b0, int count, const Q8Acts& a, int64_t r0, RowAcc* acc) const {
    const int64_t wb0 = n * a.num_blocks + b0;
    const Pairs sm = load_pairs(scale_min + 2 * wb0, 2 * count);
#if defined(RADIXSERVE_Q8_ZMM)
    __m512i w[4];  // blocks 2i, 2i + 1 (0 past count)
    for (int i = 0; i < 4; ++i) {
      const int k = 2 * i;
      w[i] = k + 1 < count ? dual_nibbles(qs + (wb0 + k) * 16)
             : k < count   ? _mm512_zextsi256_si512(nibbles16(qs + (wb0 + k) * 16))
                           : _mm512_setzero_si512();
    }
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* x = a.qs + (r0 + r) * a.K + b0 * kBlock;
      __m512i d[4];
      for (int i = 0; i < 4; ++i) {
        const int k = 2 * i;
        const __m512i xs = k + 1 < count ? _mm512_loadu_si512(x + 32 * k)
                           : k < count   ? _mm512_zextsi256_si512(load_bytes(x + 32 * k))
                                         : _mm512_setzero_si512();
        d[i] = dual_dot_us(w[i], xs);
      }
      const Pairs p = pmul(sm, load_pairs(a.pairs + 2 * ((r0 + r) * a.num_blocks + b0), 2 * count));
      acc[r].offsets = add_block_sums(acc[r].offsets, p, zblock_sums(d));
    }
#else
    Bytes w[kGroup];
    for (int k = 0; k < kGroup; ++k) w[k] = k < count ? nibbles16(qs + (wb0 + k) * 16) : Bytes{};
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* x = a.qs + (r0 + r) * a.K + b0 * kBlock;
      Ints d[kGroup];
      for (int k = 0; k < kGroup; ++k)
        d[k] = k < count ? dot_us(izero(), w[k], load_bytes(x + 32 * k)) : izero();
      const Pairs p = pmul(sm, load_pairs(a.pairs + 2 * ((r0 + r) * a.num_blocks + b0), 2 * count));
      acc[r].offsets = add_block_sums(acc[r].offsets, p, block_sums(d));
    }
#endif
  }
};

struct Int8Rows {
  static constexpr int64_t kBlock = kQ8Block;
  static constexpr int kBlocksPerGroup = kGroup;
  const int8_t* qs;
  const float* scales;
  void prefetch_row(int64_t n, int64_t nb) const {
    prefetch(qs + n * nb * kBlock, nb * kBlock);
    prefetch(scales + n * nb, nb * sizeof(float));
  }
  template <int64_t R>
  void group(int64_t n, int64_t b0, int count, const Q8Acts& a, int64_t r0, RowAcc* acc) const {
    const int64_t wb0 = n * a.num_blocks + b0;
    const Floats d = load_floats(scales + wb0, count);
    Floats p[R];
    for (int64_t r = 0; r < R; ++r)
      p[r] = fmul(d, load_floats(a.d + (r0 + r) * a.num_blocks + b0, count));
    int k = 0;
#if defined(RADIXSERVE_Q8_ZMM)
#pragma GCC unroll 4
    for (; k + 2 <= count; k += 2) {
      const __m512i w = _mm512_loadu_si512(qs + (wb0 + k) * kBlock);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(a.qs + (r0 + r) * a.K + (b0 + k) * kBlock);
        const __m512 wide = _mm512_castps256_ps512(p[r]);
        acc[r].lanes = dual_fma(acc[r].lanes, wide, k, 1, dual_dot_ss(w, x));
      }
    }
#else
#pragma GCC unroll 4
    for (; k + 2 <= count; k += 2) {
      one<R, 0>(wb0, b0, k, a, r0, p, acc);
      one<R, 1>(wb0, b0, k + 1, a, r0, p, acc);
    }
#endif
    if (k < count) one<R, 0>(wb0, b0, k, a, r0, p, acc);
  }
  template <int64_t R, int S>
  void one(int64_t wb0, int64_t b0, int k, const Q8Acts& a, int64_t r0, const Floats* p,
           RowAcc* acc) const {
    const Bytes w = load_bytes(qs + (wb0 + k) * kBlock);
    for (int64_t r = 0; r < R; ++r) {
      const Bytes x = load_bytes(a.qs + (r0 + r) * a.K + (b0 + k) * kBlock);
      acc[r].lanes = dfma<S>(acc[r].lanes, lane8(p[r], k), dot_ss(izero(), w, x));
    }
  }
};

// The K-quants take two super-blocks at a time (lane sets 0 and 1).
template <typename Self>
struct SuperBlockGroups {
  static constexpr int kBlocksPerGroup = 2;
  template <int64_t R>
  void group(int64_t n, int64_t b0, int count, const Q8Acts& a, int64_t r0, RowAcc* acc) const {
    const Self& self = static_cast<const Self&>(*this);
    self.template block<R, 0>(n, b0, a, r0, acc);
    if (count > 1) self.template block<R, 1>(n, b0 + 1, a, r0, acc);
  }
};

// Unit u's 32 codes of a Q4_K / Q5_K / Q6_K super-block (kquant_blocks.h has the layouts).
inline Bytes codes_q4k(const uint8_t* b, int u) {
  return low_bits(load_bytes(b + 16 + 32 * (u / 2)), 4 * (u % 2), 0x0F);
}
inline Bytes codes_q5k(const uint8_t* b, int u) {
  const Bytes low = low_bits(load_bytes(b + 48 + 32 * (u / 2)), 4 * (u % 2), 0x0F);
  return or_shifted(low, low_bits(load_bytes(b + 16), u, 0x01), 4);
}
inline Bytes codes_q6k(const uint8_t* b, int u) {
  const int h = u / 4, s = u % 4;
  const Bytes low = low_bits(load_bytes(b + 64 * h + 32 * (s % 2)), 4 * (s / 2), 0x0F);
  return or_shifted(low, low_bits(load_bytes(b + 128 + 32 * h), 2 * s, 0x03), 4);
}

#if defined(RADIXSERVE_Q8_ZMM)
// Units 2p and 2p + 1 of a super-block as 64 codes (q8_dual.h's zdot_scaled takes them).
inline __m512i zcodes_q4k(const uint8_t* b, int p) { return zbits(b + 16 + 32 * p, 0, 4, 0x0F); }
inline __m512i zcodes_q5k(const uint8_t* b, int p) {
  return zor_shifted(zbits(b + 48 + 32 * p, 0, 4, 0x0F), zbits(b + 16, 2 * p, 2 * p + 1, 0x01), 4);
}
inline __m512i zcodes_q6k(const uint8_t* b, int p) {  // units 4h + 2(p % 2), + 1; h = p / 2
  const int h = p / 2, s = 4 * (p % 2);
  return zor_shifted(zbits64(b + 64 * h, s, 0x0F), zbits(b + 128 + 32 * h, s, s + 2, 0x03), 4);
}
#define RADIXSERVE_ZCODES(name) name
#else
#define RADIXSERVE_ZCODES(name) nullptr
#endif

// Q4_K and Q5_K: 8 units with a 6-bit scale and min each. With AVX-512 the units go two at
// a time (`block_zmm`): the same integer sums, so the same bits as the 32-code loop.
template <int64_t kBytes, Bytes (*Codes)(const uint8_t*, int), auto ZCodes>
struct K4Rows : SuperBlockGroups<K4Rows<kBytes, Codes, ZCodes>> {
  static constexpr int64_t kBlock = kQ8KBlock;
  const uint8_t* blocks;
  void prefetch_row(int64_t n, int64_t nb) const { prefetch(blocks + n * nb * kBytes, nb * kBytes); }
  template <int64_t R, int S>
  void block(int64_t n, int64_t b, const Q8Acts& a, int64_t r0, RowAcc* acc) const {
    const uint8_t* blk = blocks + (n * a.num_blocks + b) * kBytes;
    float d, dmin;
    radixserve_kquant::halves2(blk, d, dmin);
    uint8_t sc[8], mn[8];
    radixserve_kquant::unpack_scales_k4(blk, sc, mn);
    const Words mins = words_u8_twice(mn);  // min of unit u for sums 2u, 2u + 1
#if defined(RADIXSERVE_Q8_ZMM)
    const __m512i scales = zwords_u8(sc);
    __m512i zsum[R];
    for (int64_t r = 0; r < R; ++r) zsum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i w = ZCodes(blk, p);
      const __m512i scale = zpick_words(scales, 2 * p, 4);  // sc[2p] x 16, sc[2p + 1] x 16
      for (int64_t r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(a.qs + (r0 + r) * a.K + b * kBlock + 64 * p);
        zsum[r] = zdot_scaled(zsum[r], w, x, scale);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * a.num_blocks + b;
      const int32_t msum = wdot(mins, load_words(a.bsums + ab * 16));
      acc[r].lanes = dfma<S>(acc[r].lanes, fset1(prod(d, a.d[ab])), zfold(zsum[r]));
      acc[r].scalar = std::fma(-prod(dmin, a.d[ab]), static_cast<float>(msum), acc[r].scalar);
    }
#else
    Ints isum[R][2];
    for (int64_t r = 0; r < R; ++r) isum[r][0] = isum[r][1] = izero();
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const Bytes w = Codes(blk, u);
      const Scale scale = make_scale(sc[u], sc[u]);
      for (int64_t r = 0; r < R; ++r) {
        const Bytes x = load_bytes(a.qs + (r0 + r) * a.K + b * kBlock + 32 * u);
        isum[r][u & 1] = dot_scaled(isum[r][u & 1], w, x, scale);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * a.num_blocks + b;
      const int32_t msum = wdot(mins, load_words(a.bsums + ab * 16));
      acc[r].lanes = dfma<S>(acc[r].lanes, fset1(prod(d, a.d[ab])), iadd(isum[r][0], isum[r][1]));
      acc[r].scalar = std::fma(-prod(dmin, a.d[ab]), static_cast<float>(msum), acc[r].scalar);
    }
#endif
  }
};
using Q4KRows = K4Rows<144, codes_q4k, RADIXSERVE_ZCODES(zcodes_q4k)>;
using Q5KRows = K4Rows<176, codes_q5k, RADIXSERVE_ZCODES(zcodes_q5k)>;

struct Q6KRows : SuperBlockGroups<Q6KRows> {
  static constexpr int64_t kBlock = kQ8KBlock;
  static constexpr int64_t kBytes = 210;
  const uint8_t* blocks;
  void prefetch_row(int64_t n, int64_t nb) const { prefetch(blocks + n * nb * kBytes, nb * kBytes); }
  template <int64_t R, int S>
  void block(int64_t n, int64_t b, const Q8Acts& a, int64_t r0, RowAcc* acc) const {
    const uint8_t* blk = blocks + (n * a.num_blocks + b) * kBytes;
    const float d = radixserve_kquant::half_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const Words scales = words_i8(sc);
#if defined(RADIXSERVE_Q8_ZMM)
    const __m512i zscales = zwords_i8(sc);
    __m512i zsum[R];
    for (int64_t r = 0; r < R; ++r) zsum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i w = zcodes_q6k(blk, p);
      const __m512i scale = zpick_words(zscales, 4 * p, 3);  // sc[4p .. 4p + 3], 8 lanes each
      for (int64_t r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(a.qs + (r0 + r) * a.K + b * kBlock + 64 * p);
        zsum[r] = zdot_scaled(zsum[r], w, x, scale);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * a.num_blocks + b;
      const int32_t msum = wdot(scales, load_words(a.bsums + ab * 16));
      const float dd = prod(d, a.d[ab]);
      acc[r].lanes = dfma<S>(acc[r].lanes, fset1(dd), zfold(zsum[r]));
      acc[r].scalar = std::fma(-dd, static_cast<float>(32 * msum), acc[r].scalar);
    }
#else
    Ints isum[R][2];
    for (int64_t r = 0; r < R; ++r) isum[r][0] = isum[r][1] = izero();
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const Bytes w = codes_q6k(blk, u);
      const Scale scale = make_scale(sc[2 * u], sc[2 * u + 1]);
      for (int64_t r = 0; r < R; ++r) {
        const Bytes x = load_bytes(a.qs + (r0 + r) * a.K + b * kBlock + 32 * u);
        isum[r][u & 1] = dot_scaled(isum[r][u & 1], w, x, scale);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * a.num_blocks + b;
      const int32_t msum = wdot(scales, load_words(a.bsums + ab * 16));
      const float dd = prod(d, a.d[ab]);
      acc[r].lanes = dfma<S>(acc[r].lanes, fset1(dd), iadd(isum[r][0], isum[r][1]));
      acc[r].scalar = std::fma(-dd, static_cast<float>(32 * msum), acc[r].scalar);
    }
#endif
  }
};

}  // namespace radixserve_q8
