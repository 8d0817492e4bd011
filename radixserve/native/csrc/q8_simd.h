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
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline Ints dot_ss(Ints acc, Bytes w, Bytes x) {
  return dot_us(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
inline Ints dot_scaled(Ints acc, Bytes u, Bytes s, Scale scale) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale));
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

// The two lane sets of a row's dots (even blocks, odd blocks). With AVX-512 one 512-bit
// register (set 0 in lanes 0-7, set 1 in lanes 8-15), so that two blocks take one integer dot
// and one fma (q8_formats.h); else two 8-lane vectors. The same lanes, the same ops.
#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
#define RADIXSERVE_Q8_ZMM 1
using Dual = __m512;
inline Dual dzero() { return _mm512_setzero_ps(); }
template <int S>
inline Dual dfma(Dual acc, Floats scale, Ints dot) {  // set S += scale * dot
  const __m512 a = S == 0 ? _mm512_castps256_ps512(scale)
                          : _mm512_insertf32x8(_mm512_setzero_ps(), scale, 1);
  const __m512 b = S == 0 ? _mm512_castps256_ps512(to_floats(dot))
                          : _mm512_insertf32x8(_mm512_setzero_ps(), to_floats(dot), 1);
  return _mm512_mask3_fmadd_ps(a, b, acc, S == 0 ? 0x00FF : 0xFF00);
}
inline float dsum(Dual d) {
  return fsum(_mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1)));
}
// Two blocks' codes at once: 64 bytes, block k in bytes 0-31, block k + 1 in 32-63.
inline __m512i dual_dot_us(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
inline __m512i dual_dot_ss(__m512i w, __m512i x) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
  return dual_dot_us(_mm512_abs_epi8(w), signed_x);
}
// 32 bytes = two blocks of GGUF nibbles -> [block k low, high, block k + 1 low, high].
inline __m512i dual_nibbles(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_and_si256(v, mask)),
      _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);  // [k lo, k+1 lo, k hi, k+1 hi]
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}
// The K-quants two units (64 codes) at a time: `u` the codes (unsigned), `s` the activation
// codes; int16 pair sums (below 2^15 for 6-bit codes), each times its 16-bit `scale` lane, pairs
// of those summed into the 16 int32 lanes: lane j < 8 holds codes 4j..4j+3 of the first unit,
// lane j + 8 those of the second. `zfold` adds the halves: the 8 lanes dot_scaled gives for
// the two units one after the other (the same integers, so the same bits downstream).
inline __m512i zdot_scaled(__m512i acc, __m512i u, __m512i s, __m512i scale) {
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, pairs, scale);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scale));
#endif
}
inline Ints zfold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// 32 bytes in both halves, the low half shifted right by `lo`, the high half by `hi` (16-bit
// shifts), then masked per byte.
inline __m512i zbits(const uint8_t* p, int lo, int hi, int mask) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)),
                                            _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(v, counts), _mm512_set1_epi8(static_cast<char>(mask)));
}
// 64 bytes shifted right by `shift` (16-bit shifts), masked per byte.
inline __m512i zbits64(const uint8_t* p, int shift, int mask) {
  const __m512i v = _mm512_loadu_si512(p);
  return _mm512_and_si512(shift == 0 ? v : _mm512_srli_epi16(v, static_cast<unsigned>(shift)),
                          _mm512_set1_epi8(static_cast<char>(mask)));
}
inline __m512i zor_shifted(__m512i low, __m512i high, int shift) {  // low | high << shift
  return _mm512_or_si512(low, _mm512_slli_epi16(high, static_cast<unsigned>(shift)));
}
// Up to 32 int16 scales in `words`; lane i of the result = words[first + i / 2^log2_run].
inline __m512i zpick_words(__m512i words, int first, int log2_run) {
  const __m512i iota = _mm512_set_epi32(
      0x001F001E, 0x001D001C, 0x001B001A, 0x00190018, 0x00170016, 0x00150014, 0x00130012,
      0x00110010, 0x000F000E, 0x000D000C, 0x000B000A, 0x00090008, 0x00070006, 0x00050004,
      0x00030002, 0x00010000);  // int16 lane i = i
  const __m512i index = _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(first)),
                                         _mm512_srli_epi16(iota, static_cast<unsigned>(log2_run)));
  return _mm512_permutexvar_epi16(index, words);
}
// 8 uint8 -> int16 lanes 0..7; 16 int8 -> int16 lanes 0..15 (the rest 0).
inline __m512i zwords_u8(const uint8_t* p) {
  return _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m512i zwords_i8(const int8_t* p) {
  return _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// acc += [v[i] x 8, v[i + step] x 8] * dot: blocks k and k + 1 of a group in one fma.
inline Dual dual_fma(Dual acc, __m512 v, int i, int step, __m512i dot) {
  const __m512i index = _mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(i + step), 1);
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(index, v), _mm512_cvtepi32_ps(dot), acc);
}
// The sums of the 8 blocks whose lanes d[i] holds (blocks 2i in lanes 0-7, 2i + 1 in 8-15):
// block k's in lanes 2k and 2k + 1 (exact; 128-bit quarters by a transposing add, then halves).
inline __m512i zblock_sums(const __m512i* d) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
  const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  // lane 4q + i: d[i]'s quarter q; quarters 0 + 1 are block 2i, 2 + 3 block 2i + 1
  const __m512i s = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 0, 8, 8, 1, 1, 9, 9, 2, 2, 10, 10, 3, 3, 11, 11), s);
}
// acc's lanes 2k + 1 = fma(p[2k], sums[2k + 1], acc) + p[2k + 1], as add_block_sums below.
inline __m512 zadd_block_sums(__m512 acc, __m512 p, __m512i sums) {
  return _mm512_add_ps(_mm512_fmadd_ps(_mm512_moveldup_ps(p), _mm512_cvtepi32_ps(sums), acc), p);
}
inline Pairs add_block_sums(Pairs acc, Pairs p, __m512i sums) {
  const __m512 wide = zadd_block_sums(_mm512_insertf32x8(_mm512_castps256_ps512(acc.lo), acc.hi, 1),
                                      _mm512_insertf32x8(_mm512_castps256_ps512(p.lo), p.hi, 1), sums);
  return Pairs{_mm512_castps512_ps256(wide), _mm512_extractf32x8_ps(wide, 1)};
}
#else
struct Dual {
  Floats set[2];
};
inline Dual dzero() { return Dual{{fzero(), fzero()}}; }
template <int S>
inline Dual dfma(Dual acc, Floats scale, Ints dot) {
  acc.set[S] = ffma(scale, to_floats(dot), acc.set[S]);
  return acc;
}
inline float dsum(Dual d) { return fsum(fadd(d.set[0], d.set[1])); }
#endif

// The odd lanes of `p` (the offsets of its 8 blocks), summed in one fixed order.
inline float odd_sum(const Pairs& p) {
  float v[16];
  store_pairs(p, v);
  return ((v[1] + v[3]) + (v[5] + v[7])) + ((v[9] + v[11]) + (v[13] + v[15]));
}

}  // namespace radixserve_q8
