// One SIMD level's fp32 vector, shared by the matmul kernels (block_matmul.cpp,
// dense_matmul.cpp, kquant_matmul.cpp): AVX512 or AVX2 + FMA intrinsics by the build flags
// (which follow torch's level), else 4-float plain loops. vfma rounds once on every level
// (std::fma in the portable loops), as the FMA instructions do. `simd_level` (an op of
// block_matmul.cpp) says which one a build has: every file gets the same from this header.
#pragma once

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
