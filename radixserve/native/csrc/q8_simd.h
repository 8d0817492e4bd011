// The int8-activation matmuls' vectors (q8_matmul.cpp): 32 int8 / uint8 codes (`Bytes`),
// 8 int32 lanes (`Ints`) and 8 fp32 lanes (`Floats`), on every SIMD level the same lanes:
//
//   dot_us(acc, u, s)     lane j += sum_{i<4} u[4j+i] * s[4j+i]    (u unsigned, s signed)
//   dot_ss(acc, w, x)     the same with both signed (|w| and x signed by w, as llama.cpp)
//   dot_scaled(acc, u, s, scale)   lane j += scale(j) * sum_{i<4} u[4j+i] * s[4j+i],
//                         scale(j) one int per 16 codes (lanes 0-3, lanes 4-7)
//
// AVX512-VNNI (`vpdpbusd` on 256-bit lanes) where the build has -mavx512vnni, AVX2
// (`vpmaddubsw` + `vpmaddwd`), else plain loops. Every sum is exact on every level (our codes
// keep vpmaddubsw's int16 pair sums below 2^15), and the fp32 arithmetic is the same ops in
// the same lane order (one rounding per fma, std::fma in the loops), so a matmul gives the
// same bits on every level: the tests compare them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixserve_q8 {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIntDot = "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIntDot = "avx2";
#else
constexpr const char* kIntDot = "portable";
#endif

#if defined(__AVX2__)
// An integer accumulator held in a register at this point. Without it GCC reassociates a
// chain of vpaddd (exact, so it may) into a tree that computes every vpmaddwd product of an
// unrolled loop first and spills them: the 4-row x8 K-quant steps stored 25-300 vectors to
// the stack, and took up to 1.4x longer (docs/performance.md, "Integer accumulators pinned").
template <typename V>
inline V pinned(V v) {
  asm("" : "+v"(v));
  return v;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
using Bytes = __m256i;
using Ints = __m256i;
using Floats = __m256;
using Scale = __m256i;  // the two int16 scales, 8 copies each (vpmaddwd's second operand)

inline Bytes load_bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline Ints izero() { return _mm256_setzero_si256(); }
inline Ints iadd(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Scale make_scale(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)),
                          _mm_set1_epi16(static_cast<int16_t>(lo)));
}
inline Ints dot_us(Ints acc, Bytes u, Bytes s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return pinned(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
#endif
}
inline Ints dot_ss(Ints acc, Bytes w, Bytes x) {
  return dot_us(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
inline Ints dot_scaled(Ints acc, Bytes u, Bytes s, Scale scale) {
  return pinned(_mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale)));
}
inline Floats fzero() { return _mm256_setzero_ps(); }
inline Floats fset1(float a) { return _mm256_set1_ps(a); }
inline Floats to_floats(Ints a) { return _mm256_cvtepi32_ps(a); }
inline Floats ffma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats fadd(Floats a, Floats b) { return _mm256_add_ps(a, b); }
// (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)), as simd.h's AVX2 vsum
inline float fsum(Floats a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Byte-wise shifts and masks for the weight decoders (16-bit shifts; the mask drops what
// crossed from the neighbouring byte).
inline Bytes low_bits(Bytes v, int shift, int mask) {
  const __m256i shifted = shift == 0 ? v : _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(static_cast<char>(mask)));
}
inline Bytes or_shifted(Bytes low, Bytes high, int shift) {  // low | high << shift (no carry)
  return _mm256_or_si256(low, _mm256_sll_epi16(high, _mm_cvtsi32_si128(shift)));
}
// 16 bytes, each two 4-bit codes: [low nibbles, high nibbles] (GGUF's Q4_0 / Q4_1 order).
inline Bytes nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// 16 int16 lanes: the K-quants' per-16 activation sums against the blocks' scales / mins.
using Words = __m256i;
inline Words load_words(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Words words_i8(const int8_t* p) {  // 16 int8 -> 16 int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Words words_u8_twice(const uint8_t* p) {  // 8 uint8, each twice -> 16 int16
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
}
inline int32_t wdot(Words a, Words b) {  // sum a[j] * b[j], exact
  const __m256i p = _mm256_madd_epi16(a, b);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 16 fp32 lanes (`Pairs`: 8 blocks' (scale, offset) pairs) and 8 lanes of per-block scales,
// loaded `count` at a time (the rest 0), each block's product then broadcast to the 8 lanes of
// its integer dot.
struct Pairs {
  __m256 lo, hi;
};
inline __m256i first_lanes(int count) {  // lane j set where j < count
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Floats load_floats(const float* p, int count) {
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(count));
}
inline Pairs pzero() { return Pairs{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Pairs load_pairs(const float* p, int count) {
  return Pairs{load_floats(p, count), count > 8 ? load_floats(p + 8, count - 8) : _mm256_setzero_ps()};
}
inline Floats fopaque(Floats v) { __asm__("" : "+x"(v)); return v; }
inline Floats fmul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Pairs pmul(Pairs a, Pairs b) {  // each product rounded, never fused into an add
  return Pairs{fopaque(_mm256_mul_ps(a.lo, b.lo)), fopaque(_mm256_mul_ps(a.hi, b.hi))};
}
inline Pairs padd(Pairs a, Pairs b) {
  return Pairs{_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline Floats lane8(Floats v, int i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i)); }
inline Floats lane16(const Pairs& p, int i) { return lane8(i < 8 ? p.lo : p.hi, i & 7); }
inline void store_pairs(const Pairs& p, float* out) {
  _mm256_storeu_ps(out, p.lo);
  _mm256_storeu_ps(out + 8, p.hi);
}
// Int4's per-block integer sums: block k's in lane 2k + 1 of 16 (lo: k < 4, hi: k >= 4).
struct BlockSums {
  Ints lo, hi;
};
// The 8 sums of d[k]'s lanes (exact; pairs, then quads by hadd, then the 128-bit halves).
inline BlockSums block_sums(const Ints* d) {
  __m128i four[2];
  for (int h = 0; h < 2; ++h) {
    const Ints* q = d + 4 * h;
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    four[h] = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  }
  return BlockSums{_mm256_slli_epi64(_mm256_cvtepu32_epi64(four[0]), 32),
                   _mm256_slli_epi64(_mm256_cvtepu32_epi64(four[1]), 32)};
}
// acc's odd lanes 2k + 1 = fma(p[2k], sum k, acc) + p[2k + 1] (p: d_w d_x, m_w d_x sum q_x).
inline __m256 add_block_sums8(__m256 acc, __m256 p, Ints sums) {
  return _mm256_add_ps(_mm256_fmadd_ps(_mm256_moveldup_ps(p), _mm256_cvtepi32_ps(sums), acc), p);
}
inline Pairs add_block_sums(Pairs acc, Pairs p, BlockSums s) {
  return Pairs{add_block_sums8(acc.lo, p.lo, s.lo), add_block_sums8(acc.hi, p.hi, s.hi)};
}
#else
struct Bytes {
  uint8_t v[32];
};
struct Ints {
  int32_t v[8];
};
struct Floats {
  float v[8];
};
struct Scale {
  int32_t lo, hi;
};

inline Bytes load_bytes(const void* p) { Bytes b; std::memcpy(b.v, p, sizeof(b.v)); return b; }
inline Ints izero() { return Ints{}; }
inline Ints iadd(Ints a, Ints b) {
  for (int j = 0; j < 8; ++j) a.v[j] += b.v[j];
  return a;
}
inline Scale make_scale(int lo, int hi) { return Scale{lo, hi}; }
inline int32_t quad(const Bytes& u, const Bytes& s, int j, bool u_signed) {
  int32_t sum = 0;
  for (int i = 4 * j; i < 4 * j + 4; ++i) {
    const int32_t a = u_signed ? static_cast<int8_t>(u.v[i]) : u.v[i];
    sum += a * static_cast<int8_t>(s.v[i]);
  }
  return sum;
}
inline Ints dot_us(Ints acc, Bytes u, Bytes s) {
  for (int j = 0; j < 8; ++j) acc.v[j] += quad(u, s, j, false);
  return acc;
}
inline Ints dot_ss(Ints acc, Bytes w, Bytes x) {
  for (int j = 0; j < 8; ++j) acc.v[j] += quad(w, x, j, true);
  return acc;
}
inline Ints dot_scaled(Ints acc, Bytes u, Bytes s, Scale scale) {
  for (int j = 0; j < 8; ++j) acc.v[j] += (j < 4 ? scale.lo : scale.hi) * quad(u, s, j, false);
  return acc;
}
inline Floats fzero() { return Floats{}; }
inline Floats fset1(float a) { Floats f; for (float& v : f.v) v = a; return f; }
inline Floats to_floats(Ints a) {
  Floats f;
  for (int j = 0; j < 8; ++j) f.v[j] = static_cast<float>(a.v[j]);
  return f;
}
inline Floats ffma(Floats a, Floats b, Floats c) {
  for (int j = 0; j < 8; ++j) c.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
  return c;
}
inline Floats fadd(Floats a, Floats b) {
  for (int j = 0; j < 8; ++j) a.v[j] += b.v[j];
  return a;
}
inline float fsum(Floats a) {
  float s[4];
  for (int j = 0; j < 4; ++j) s[j] = a.v[j] + a.v[j + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
inline Bytes low_bits(Bytes v, int shift, int mask) {
  for (uint8_t& b : v.v) b = static_cast<uint8_t>((b >> shift) & mask);
  return v;
}
inline Bytes or_shifted(Bytes low, Bytes high, int shift) {
  for (int i = 0; i < 32; ++i) low.v[i] = static_cast<uint8_t>(low.v[i] | high.v[i] << shift);
  return low;
}
inline Bytes nibbles16(const uint8_t* p) {
  Bytes b;
  for (int i = 0; i < 16; ++i) {
    b.v[i] = p[i] & 0x0F;
    b.v[i + 16] = p[i] >> 4;
  }
  return b;
}

struct Words {
  int32_t v[16];
};
inline Words load_words(const int16_t* p) { Words w; for (int j = 0; j < 16; ++j) w.v[j] = p[j]; return w; }
inline Words words_i8(const int8_t* p) { Words w; for (int j = 0; j < 16; ++j) w.v[j] = p[j]; return w; }
inline Words words_u8_twice(const uint8_t* p) {
  Words w;
  for (int j = 0; j < 16; ++j) w.v[j] = p[j / 2];
  return w;
}
inline int32_t wdot(Words a, Words b) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += a.v[j] * b.v[j];
  return s;
}

struct Pairs {
  float v[16];
};
inline Floats load_floats(const float* p, int count) {
  Floats f{};
  for (int j = 0; j < count && j < 8; ++j) f.v[j] = p[j];
  return f;
}
inline Pairs pzero() { return Pairs{}; }
inline Pairs load_pairs(const float* p, int count) {
  Pairs f{};
  for (int j = 0; j < count && j < 16; ++j) f.v[j] = p[j];
  return f;
}
inline Floats fmul(Floats a, Floats b) {
  for (int j = 0; j < 8; ++j) a.v[j] *= b.v[j];
  return a;
}
inline Pairs pmul(Pairs a, Pairs b) {
  for (int j = 0; j < 16; ++j) a.v[j] *= b.v[j];
  return a;
}
inline Pairs padd(Pairs a, Pairs b) {
  for (int j = 0; j < 16; ++j) a.v[j] += b.v[j];
  return a;
}
inline Floats lane8(Floats v, int i) { return fset1(v.v[i]); }
inline Floats lane16(const Pairs& p, int i) { return fset1(p.v[i]); }
inline void store_pairs(const Pairs& p, float* out) { std::memcpy(out, p.v, sizeof(p.v)); }
struct BlockSums {
  int32_t v[8];
};
inline BlockSums block_sums(const Ints* d) {
  BlockSums s{};
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 8; ++j) s.v[k] += d[k].v[j];
  return s;
}
inline Pairs add_block_sums(Pairs acc, Pairs p, BlockSums s) {
  for (int k = 0; k < 8; ++k)
    acc.v[2 * k + 1] = std::fma(p.v[2 * k], static_cast<float>(s.v[k]), acc.v[2 * k + 1]) + p.v[2 * k + 1];
  return acc;
}
#endif

}  // namespace radixserve_q8
