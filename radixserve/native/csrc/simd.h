// One SIMD level's fp32 vector, shared by the matmul kernels (block_matmul.cpp,
// dense_matmul.cpp, kquant_matmul.cpp): AVX512 or AVX2 + FMA intrinsics by the build flags
// (which follow torch's level), else 4-float plain loops. vfma rounds once on every level
// (std::fma in the portable loops), as the FMA instructions do. `simd_level` (an op of
// block_matmul.cpp) says which one a build has: every file gets the same from this header.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu::simd {

#if defined(__AVX512F__)
constexpr const char* kSimd = "avx512";
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
// a rounded to bf16 at p: to nearest even on the bits, as torch rounds (NaN: a quiet NaN).
inline void vstore(c10::BFloat16* p, Vec a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kSimd = "avx2";
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline void vstore(c10::BFloat16* p, Vec a) {  // as AVX512's
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr const char* kSimd = "portable";
struct Vec {
  float v[4];
};
constexpr int64_t kLanes = 4;
inline Vec vzero() { return Vec{}; }
inline Vec vset1(float a) { return Vec{{a, a, a, a}}; }
inline Vec vload(const float* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline void vstore(float* p, Vec a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline void vstore(c10::BFloat16* p, Vec a) {  // c10's rounding: to nearest even
  for (int64_t j = 0; j < kLanes; ++j) p[j] = c10::BFloat16(a.v[j]);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int64_t j = 0; j < kLanes; ++j) c.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
  return c;
}
inline Vec vadd(Vec a, Vec b) {
  for (int64_t j = 0; j < kLanes; ++j) a.v[j] += b.v[j];
  return a;
}
inline float vsum(Vec a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
#endif

}  // namespace radixserve_cpu::simd
