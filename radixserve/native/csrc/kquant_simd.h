// One SIMD level's view of K-quant units for kquant_matmul.cpp: 32 fp32 weights as kVecs of
// simd.h's vectors, and each format's unit decoder (kquant_blocks.h has the layouts and the
// plain reference decoders). AVX512 and AVX2 by intrinsics, chosen by the build flags;
// anything else the plain loops (correct, slower: `simd_level()` says which was built).
#pragma once

#include "kquant_blocks.h"
#include "simd.h"

namespace radixserve_kquant::simd {

using namespace radixserve_cpu::simd;

#if defined(__AVX512F__)
constexpr int64_t kChains = 2;  // units alternate between accumulator sets (FMA latency)
inline Vec vopaque(Vec v) { __asm__("" : "+v"(v)); return v; }
inline __m512i widen(const uint8_t* p) {  // 16 bytes -> 16 int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// v >> bits; bits is a constant once the unit loop is unrolled (0: v itself)
inline __m512i shift_right(__m512i v, int64_t bits) {
  return bits == 0 ? v : _mm512_srl_epi32(v, _mm_cvtsi32_si128(static_cast<int>(bits)));
}
// The 16 weights codes c..c+15 stand for, c * scale - min (two roundings): a table that one
// vpermps per 16 weights reads (its index: the low 4 bits of each lane).
inline Vec table16(float first, float scale, float min) {
  const Vec iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec codes = _mm512_add_ps(_mm512_set1_ps(first), iota);
  return _mm512_sub_ps(vopaque(_mm512_mul_ps(codes, _mm512_set1_ps(scale))), _mm512_set1_ps(min));
}
inline void unit_q4k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const uint8_t* qs = b + 16 + 32 * (u / 2);
  const Vec table = table16(0, s.scale[u], s.min[u]);
  for (int64_t i = 0; i < 2; ++i) {
    const __m512i v = widen(qs + 16 * i);  // vpermps reads the low 4 bits: no mask
    w[i] = _mm512_permutexvar_ps(u % 2 ? shift_right(v, 4) : v, table);
  }
}
inline void unit_q5k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const uint8_t* qs = b + 48 + 32 * (u / 2);
  const Vec low = table16(0, s.scale[u], s.min[u]), high = table16(16, s.scale[u], s.min[u]);
  const __m512i nibble = _mm512_set1_epi32(0xF), bit = _mm512_set1_epi32(1 << u);
  for (int64_t i = 0; i < 2; ++i) {
    const __m512i q = _mm512_and_si512(shift_right(widen(qs + 16 * i), 4 * (u % 2)), nibble);
    const __mmask16 has_bit = _mm512_test_epi32_mask(widen(b + 16 + 16 * i), bit);
    const __m512i index = _mm512_mask_or_epi32(q, has_bit, q, _mm512_set1_epi32(16));
    w[i] = _mm512_permutex2var_ps(low, index, high);
  }
}
// Q6_K's 2 high bits of part `part` moved to bits 4-5 (other bits: masked by the caller).
inline __m512i high_pair_q6(__m512i qh, int64_t part) {
  if (part == 0) return _mm512_slli_epi32(qh, 4);
  if (part == 1) return _mm512_slli_epi32(qh, 2);
  return part == 2 ? qh : _mm512_srli_epi32(qh, 2);
}
inline void unit_q6k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const int64_t h = u / 4, part = u % 4;
  const uint8_t* ql = b + 64 * h + 32 * (part % 2);
  const uint8_t* qh = b + 128 + 32 * h;
  const __m512i nibble = _mm512_set1_epi32(0xF), pair = _mm512_set1_epi32(0x30);
  for (int64_t i = 0; i < 2; ++i) {
    const __m512i v = widen(ql + 16 * i);
    const __m512i low = part < 2 ? _mm512_and_si512(v, nibble) : _mm512_srli_epi32(v, 4);
    const __m512i high = high_pair_q6(widen(qh + 16 * i), part);
    const __m512i q = _mm512_ternarylogic_epi32(low, high, pair, 0xF8);  // low | high & pair
    const Vec scale = _mm512_set1_ps(s.scale[2 * u + i]), min = _mm512_set1_ps(s.min[2 * u + i]);
    w[i] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), scale, min);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kChains = 1;  // four vectors a unit already make four FMA chains
inline Vec vopaque(Vec v) { __asm__("" : "+x"(v)); return v; }
inline __m256i widen(const uint8_t* p) {  // 8 bytes -> 8 int32
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// v >> bits; bits is a constant once the unit loop is unrolled (0: v itself)
inline __m256i shift_right(__m256i v, int64_t bits) {
  return bits == 0 ? v : _mm256_srl_epi32(v, _mm_cvtsi32_si128(static_cast<int>(bits)));
}
inline Vec scale_sub(__m256i q, float scale, float min) {  // q * scale - min, two roundings
  const Vec product = vopaque(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale)));
  return _mm256_sub_ps(product, _mm256_set1_ps(min));
}
inline void unit_q4k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const uint8_t* qs = b + 16 + 32 * (u / 2);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  for (int64_t i = 0; i < 4; ++i) {
    const __m256i q = _mm256_and_si256(shift_right(widen(qs + 8 * i), 4 * (u % 2)), nibble);
    w[i] = scale_sub(q, s.scale[u], s.min[u]);
  }
}
inline void unit_q5k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const uint8_t* qs = b + 48 + 32 * (u / 2);
  const __m256i nibble = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
  for (int64_t i = 0; i < 4; ++i) {
    const __m256i low = _mm256_and_si256(shift_right(widen(qs + 8 * i), 4 * (u % 2)), nibble);
    const __m256i high = _mm256_and_si256(shift_right(widen(b + 16 + 8 * i), u), one);
    w[i] = scale_sub(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), s.scale[u], s.min[u]);
  }
}
inline __m256i high_pair_q6(__m256i qh, int64_t part) {  // as the AVX-512 one
  if (part == 0) return _mm256_slli_epi32(qh, 4);
  if (part == 1) return _mm256_slli_epi32(qh, 2);
  return part == 2 ? qh : _mm256_srli_epi32(qh, 2);
}
inline void unit_q6k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  const int64_t h = u / 4, part = u % 4;
  const uint8_t* ql = b + 64 * h + 32 * (part % 2);
  const uint8_t* qh = b + 128 + 32 * h;
  const __m256i nibble = _mm256_set1_epi32(0xF), pair = _mm256_set1_epi32(0x30);
  for (int64_t i = 0; i < 4; ++i) {
    const __m256i v = widen(ql + 8 * i);
    const __m256i low = part < 2 ? _mm256_and_si256(v, nibble) : _mm256_srli_epi32(v, 4);
    const __m256i high = _mm256_and_si256(high_pair_q6(widen(qh + 8 * i), part), pair);
    const Vec scale = _mm256_set1_ps(s.scale[2 * u + i / 2]);
    const Vec min = _mm256_set1_ps(s.min[2 * u + i / 2]);
    w[i] = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_or_si256(low, high)), scale, min);
  }
}
#else
constexpr int64_t kChains = 1;
inline void unit_q4k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  unit_q4_k(b, u, s, reinterpret_cast<float*>(w));  // kVecs plain Vecs: the unit's 32 floats
}
inline void unit_q5k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  unit_q5_k(b, u, s, reinterpret_cast<float*>(w));
}
inline void unit_q6k(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
  unit_q6_k(b, u, s, reinterpret_cast<float*>(w));
}
#endif
constexpr int64_t kVecs = kUnit / kLanes;

}  // namespace radixserve_kquant::simd
