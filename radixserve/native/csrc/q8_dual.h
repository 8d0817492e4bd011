// A row's accumulators in the int8-activation matmuls (q8_formats.h): the two lane sets of
// its block dots (`Dual`), AVX-512's two-block integer dots and their fma, and the fixed-order
// sum of the offsets' lanes, built on q8_simd.h's vectors and held to its contract: the same
// lanes and ops on every level, so the same bits.
#pragma once

#include "q8_simd.h"

#include <cstdint>

namespace radixserve_q8 {

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
  return pinned(_mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scale)));
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
