// A GGUF-style weight block (32 inputs: Q4_0 / Q4_1 nibbles with a scale and offset, Q8_0
// bytes with a scale) dequantized to fp32 vectors at the build's SIMD level (simd.h): the one
// definition of those weights that block_matmul.cpp's kernels multiply and that the
// dequantize ops (row layout and the repacked 8-row layout, int4_x8.cpp) write out.
#pragma once

#include "common.h"
#include "simd.h"

#include <cstdint>

namespace radixserve_blocks {

using namespace radixserve_cpu::simd;
using radixserve_cpu::prefetch;

constexpr int64_t kBlock = 32;  // inputs per weight block (GGUF's QK4_0 / QK4_1 / QK8_0)
constexpr int64_t kHalf = kBlock / 2;

// One SIMD level's view of a block (simd.h's vectors): 32 fp32 weights as kVecs vectors of
// kLanes and their dequantizers. AVX512 and AVX2 use intrinsics; anything else plain loops
// (correct, but slower than torch's kernels: `simd_level` says which was built).
#if defined(__AVX512F__)
constexpr int64_t kChains = 2;  // blocks alternate between accumulator sets (FMA latency)
// The block's 16 possible weights q * d + m as a table (one FMA), then a lookup per lane
// (vpermps reads the low 4 bits of each index: the low nibble without a mask): fewer
// instructions than converting and scaling each code, the same fp32 values.
inline void dequant_int4(const uint8_t* lo, const uint8_t* hi, float d, float m, Vec* w) {
  const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi)));
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  const Vec codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec table = vfma(codes, _mm512_set1_ps(d), _mm512_set1_ps(m));
  w[0] = _mm512_permutexvar_ps(v, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
inline void dequant_int8(const int8_t* q, float d, Vec* w) {
  const Vec vd = _mm512_set1_ps(d);
  for (int64_t i = 0; i < 2; ++i) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i));
    w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vd);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kChains = 1;  // four vectors a block already make four FMA chains
inline __m256i widen_u8(const uint8_t* q) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}
inline void dequant_int4(const uint8_t* lo, const uint8_t* hi, float d, float m, Vec* w) {
  const Vec vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t i = 0; i < 2; ++i) {  // bytes 8i..8i+7: elements 8i.. (low), 16+8i.. (high)
    const __m256i v = widen_u8(i == 0 ? lo : hi);
    w[i] = vfma(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), vd, vm);
    w[i + 2] = vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), vd, vm);
  }
}
inline void dequant_int8(const int8_t* q, float d, Vec* w) {
  const Vec vd = _mm256_set1_ps(d);
  for (int64_t i = 0; i < 4; ++i) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd);
  }
}
// The factored matmul's codes (block_matmul.cpp): a block's 32 codes as fp32 (exact), in
// dequant_int4's / dequant_int8's element order, before any scale.
#define RADIXSERVE_BLOCKS_FACTORED 1
inline __attribute__((always_inline)) void codes_int4(const uint8_t* lo, const uint8_t* hi,
                                                      Vec* c) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t i = 0; i < 2; ++i) {
    const __m256i v = widen_u8(i == 0 ? lo : hi);
    c[i] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    c[i + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
}
inline __attribute__((always_inline)) void codes_int8(const int8_t* q, Vec* c) {
  for (int64_t i = 0; i < 4; ++i) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    c[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}
#else
constexpr int64_t kChains = 1;
inline void dequant_int4(const uint8_t* lo, const uint8_t* hi, float d, float m, Vec* w) {
  for (int64_t j = 0; j < kHalf; ++j) {
    const uint8_t q = j < kHalf / 2 ? lo[j] : hi[j - kHalf / 2];
    w[j / kLanes].v[j % kLanes] = static_cast<float>(q & 0x0F) * d + m;
    w[(j + kHalf) / kLanes].v[j % kLanes] = static_cast<float>(q >> 4) * d + m;
  }
}
inline void dequant_int8(const int8_t* q, float d, Vec* w) {
  for (int64_t j = 0; j < kBlock; ++j) w[j / kLanes].v[j % kLanes] = static_cast<float>(q[j]) * d;
}
#endif
constexpr int64_t kVecs = kBlock / kLanes;
// A block's 32 weights from its 16 code bytes at q (bytes 0-7 and 8-15 may lie apart:
// dequant_int4's `lo` and `hi`, as in the 8-row layout).
inline void dequant_int4(const uint8_t* q, float d, float m, Vec* w) {
  dequant_int4(q, q + kHalf / 2, d, m, w);
}

}  // namespace radixserve_blocks
