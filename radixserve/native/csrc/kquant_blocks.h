// GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each), decoded 32 weights (one
// "unit") at a time into fp32 SIMD vectors for kquant_matmul.cpp. Bytes of one super-block,
// as llama.cpp's ggml-common.h lays them out:
//
//   Q4_K (144 B)  d f16 | dmin f16 | scales[12]: 8 x (6-bit sc, 6-bit m) | qs[128] nibbles
//   Q5_K (176 B)  d f16 | dmin f16 | scales[12]                | qh[32] | qs[128] nibbles
//   Q6_K (210 B)  ql[128] nibbles | qh[64] 2-bit pairs | scales[16] int8 | d f16
//
//   Q4_K / Q5_K unit u (0..7): w = (d * sc[u]) * q - (dmin * m[u]); q = nibble of
//     qs[32 * (u / 2) + l] (low for even u, high for odd), l = 0..31; Q5_K adds bit u of
//     qh[l] as q's fifth bit.
//   Q6_K unit u = 4h + s (h = 0..1, s = 0..3): q = nibble s / 2 of ql[64h + 32(s % 2) + l]
//     | bits 2s..2s+1 of qh[32h + l] << 4; w = (d * scales[2u + l / 16]) * (q - 32).
//
// Each weight is computed exactly as the gguf package's numpy dequantizer (the reference)
// does: the scale and min products rounded to fp32, then one multiply and one subtraction,
// never fused (`opaque` stops the compiler from contracting them into an FMA), so the
// kernels multiply by the very weights `--quantization none` dequantizes to.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_kquant {

constexpr int64_t kSuper = 256;  // weights per super-block (GGUF's QK_K)
constexpr int64_t kUnit = 32;    // weights decoded at a time
constexpr int64_t kUnits = kSuper / kUnit;

// The per-unit factors of one super-block: Q4_K / Q5_K fill scale[0..7] and min[0..7];
// Q6_K fills scale[0..15] (one per 16 weights).
struct SuperScales {
  float scale[16];
  float min[16];  // Q6_K: 32 * scale, so w = q * scale - min with q in 0..63 (one FMA, exact)
};

// The fp16 value at p as fp32 (AVX-512 converts in one instruction; otherwise c10's bit
// manipulation: the same value).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__AVX512F__)
  return _mm_cvtss_f32(_mm512_castps512_ps128(
      _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(bits))))));
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_K / Q5_K: 8 pairs of 6-bit scale and min packed into 12 bytes (get_scale_min_k4),
// unpacked four at a time in 32-bit words: bytes 0-3 hold scales 0-3 (low 6 bits) and the top
// bits of scales 4-7, bytes 4-7 mins 0-3 and the top bits of mins 4-7, bytes 8-11 the low
// nibbles of scales 4-7 and mins 4-7.
// The 8 scale bytes and 8 min bytes of a Q4_K / Q5_K super-block, unpacked.
inline void unpack_scales_k4(const uint8_t* block, uint8_t* scales, uint8_t* mins) {
  uint32_t q[3], sc[2], mn[2];
  std::memcpy(q, block + 4, sizeof(q));
  sc[0] = q[0] & 0x3F3F3F3Fu;
  mn[0] = q[1] & 0x3F3F3F3Fu;
  sc[1] = (q[2] & 0x0F0F0F0Fu) | ((q[0] >> 6) & 0x03030303u) << 4;
  mn[1] = ((q[2] >> 4) & 0x0F0F0F0Fu) | ((q[1] >> 6) & 0x03030303u) << 4;
  std::memcpy(scales, sc, sizeof(sc));
  std::memcpy(mins, mn, sizeof(mn));
}

// out[j] = d * bytes[j] for 8 bytes (each product rounded once, as the reference does).
inline void scale_bytes8(const uint8_t* bytes, float d, float* out) {
#if defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
  _mm256_storeu_ps(out, _mm256_mul_ps(v, _mm256_set1_ps(d)));
#else
  for (int j = 0; j < 8; ++j) out[j] = d * static_cast<float>(bytes[j]);
#endif
}

// The d and dmin at the front of a Q4_K / Q5_K super-block (AVX-512 converts fp16 in one
// instruction; otherwise c10's bit manipulation).
inline void halves2(const uint8_t* p, float& d, float& dmin) {
#if defined(__AVX512F__)
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const __m128 both = _mm512_castps512_ps128(
      _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(bits)))));
  d = _mm_cvtss_f32(both);
  dmin = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
  d = half_at(p);
  dmin = half_at(p + 2);
#endif
}

inline void scales_k4(const uint8_t* block, SuperScales& s) {
  float d, dmin;
  halves2(block, d, dmin);
  uint8_t scales[8], mins[8];
  unpack_scales_k4(block, scales, mins);
  scale_bytes8(scales, d, s.scale);
  scale_bytes8(mins, dmin, s.min);
}

inline void scales_q6(const uint8_t* block, SuperScales& s) {
  const float d = half_at(block + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
#if defined(__AVX2__)
  for (int half = 0; half < 2; ++half) {  // 8 int8 scales at a time, as the loop below
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * half));
    const __m256 scale = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                                       _mm256_set1_ps(d));
    _mm256_storeu_ps(s.scale + 8 * half, scale);
    _mm256_storeu_ps(s.min + 8 * half, _mm256_mul_ps(scale, _mm256_set1_ps(32.f)));
  }
#else
  for (int j = 0; j < 16; ++j) {
    s.scale[j] = d * static_cast<float>(sc[j]);
    s.min[j] = 32.f * s.scale[j];  // exact: a power of two
  }
#endif
}

// The 6-bit code (0..63) of element l of Q6_K unit u; the portable path and the tests' view.
inline int code_q6(const uint8_t* block, int64_t u, int64_t l) {
  const int64_t h = u / 4, s = u % 4;
  const int low = block[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2)) & 0xF;
  const int high = block[128 + 32 * h + l] >> (2 * s) & 3;
  return low | (high << 4);
}

inline int code_k4(const uint8_t* qs, int64_t u, int64_t l) {
  return qs[32 * (u / 2) + l] >> (4 * (u % 2)) & 0xF;
}

// A value the compiler must treat as unknown: keeps q * scale and - min two roundings
// (GCC contracts a * b - c into an FMA where the target has one).
inline float opaque(float v) {
#if defined(__GNUC__)
  __asm__("" : "+g"(v));
#endif
  return v;
}

// One unit's 32 weights as fp32, plainly: the portable path.
inline void unit_q4_k(const uint8_t* block, int64_t u, const SuperScales& s, float* w) {
  for (int64_t l = 0; l < kUnit; ++l)
    w[l] = opaque(s.scale[u] * static_cast<float>(code_k4(block + 16, u, l))) - s.min[u];
}
inline void unit_q5_k(const uint8_t* block, int64_t u, const SuperScales& s, float* w) {
  for (int64_t l = 0; l < kUnit; ++l) {
    const int q = code_k4(block + 48, u, l) | ((block[16 + l] >> u & 1) << 4);
    w[l] = opaque(s.scale[u] * static_cast<float>(q)) - s.min[u];
  }
}
inline void unit_q6_k(const uint8_t* block, int64_t u, const SuperScales& s, float* w) {
  for (int64_t l = 0; l < kUnit; ++l)
    w[l] = s.scale[2 * u + l / 16] * static_cast<float>(code_q6(block, u, l) - 32);
}

// Q4_K, Q5_K and Q6_K rows repacked 8 at a time (q8_kquant_x8.h's kernels read them): our own type
// ids (ggml's + 1000). The tensor keeps its shape and bytes: rows 8g .. 8g + 7 (a group) are
// nb "x8 super-blocks" of 8 x the format's bytes, where the 8 rows' super-blocks b lay; rows
// past the last full group stay as the file has them. An x8 super-block, row r's parts at:
//
//   Q4_K (1152 B)  d[8] f16 | dmin[8] f16 | scale bytes 4w .. 4w + 3 at 32 + 32w + 4r (w < 3) |
//                  qs: for p, c < 4, 64 bytes: qs[32p + 8c .. + 7] at 8r
//   Q5_K (1408 B)  Q4_K's 1152 bytes, then qh: for c < 4, 64 bytes: qh[8c .. + 7] at 8r
//   Q6_K (1680 B)  d[8] f16 | scales: for z < 4, 32 bytes: scales[4z .. + 3] at 4r |
//                  for h < 2, c < 4: 3 x 64 bytes: ql[64h + 8c .. + 7], ql[64h + 32 + 8c ..
//                  + 7], qh[32h + 8c .. + 7], each at 8r
//
// so that one 64-byte load holds 8 codes (8c .. 8c + 7 of a unit) of all 8 rows.
constexpr int64_t kX8Rows = 8;
constexpr int64_t kX8Type = 1000;  // a repacked format's id: its ggml id + this
constexpr int64_t kQ4KX8 = 12 + kX8Type, kQ5KX8 = 13 + kX8Type, kQ6KX8 = 14 + kX8Type;

// Where row r's bytes of one super-block lie in its x8 super-block: fn(offset there, offset in
// the file's block, bytes), piece by piece.
template <bool kFifthBit>  // Q5_K: Q4_K's pieces (its qs 32 bytes later) and qh
struct K4X8Layout {
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  template <typename Fn>
  static void pieces(int64_t r, Fn&& fn) {
    const int64_t qs = kFifthBit ? 48 : 16;
    fn(2 * r, 0, 2);
    fn(16 + 2 * r, 2, 2);
    for (int64_t w = 0; w < 3; ++w) fn(32 + 32 * w + 4 * r, 4 + 4 * w, 4);
    for (int64_t p = 0; p < 4; ++p)
      for (int64_t c = 0; c < 4; ++c) fn(128 + 256 * p + 64 * c + 8 * r, qs + 32 * p + 8 * c, 8);
    if (kFifthBit)
      for (int64_t c = 0; c < 4; ++c) fn(1152 + 64 * c + 8 * r, 16 + 8 * c, 8);
  }
};
using Q4KX8Layout = K4X8Layout<false>;
using Q5KX8Layout = K4X8Layout<true>;
struct Q6KX8Layout {
  static constexpr int64_t kBytes = 210;
  template <typename Fn>
  static void pieces(int64_t r, Fn&& fn) {
    fn(2 * r, 208, 2);
    for (int64_t z = 0; z < 4; ++z) fn(16 + 32 * z + 4 * r, 192 + 4 * z, 4);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t c = 0; c < 4; ++c) {
        const int64_t at = 144 + 192 * (4 * h + c) + 8 * r;  // in the order the kernel reads
        for (int64_t s = 0; s < 2; ++s) fn(at + 64 * s, 64 * h + 32 * s + 8 * c, 8);
        fn(at + 128, 128 + 32 * h + 8 * c, 8);
      }
  }
};

// 8 rows of super-blocks (the file's row layout) -> one repacked group, and back.
template <typename L>
void repack_x8_group(const uint8_t* rows, uint8_t* group, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < kX8Rows; ++r)
      L::pieces(r, [&](int64_t at, int64_t from, int64_t n) {
        std::memcpy(group + (b * kX8Rows) * L::kBytes + at, rows + (r * nb + b) * L::kBytes + from, n);
      });
}
template <typename L>
void unpack_x8_group(const uint8_t* group, uint8_t* rows, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < kX8Rows; ++r)
      L::pieces(r, [&](int64_t from, int64_t at, int64_t n) {
        std::memcpy(rows + (r * nb + b) * L::kBytes + at, group + (b * kX8Rows) * L::kBytes + from, n);
      });
}

// Calls fn(rows, first, count) over weight rows [n0, n1) of repacked weights `w` ([N, nb *
// bytes]) with `rows` holding rows first .. first + count - 1 in the file's row layout (each
// group unpacked into a buffer): the row-layout kernels' way onto the repacked bytes.
template <typename L, typename Fn>
void for_rows_unpacked(const uint8_t* w, int64_t N, int64_t nb, int64_t n0, int64_t n1, Fn&& fn) {
  const int64_t row_bytes = nb * L::kBytes, grouped = N / kX8Rows * kX8Rows;
  std::vector<uint8_t> buffer(kX8Rows * row_bytes);
  for (int64_t g0 = n0 / kX8Rows * kX8Rows; g0 < std::min(n1, grouped); g0 += kX8Rows) {
    unpack_x8_group<L>(w + g0 * row_bytes, buffer.data(), nb);
    const int64_t first = std::max(n0, g0), last = std::min(n1, g0 + kX8Rows);
    fn(buffer.data() + (first - g0) * row_bytes, first, last - first);
  }
  const int64_t tail = std::max(n0, grouped);
  if (n1 > tail) fn(w + tail * row_bytes, tail, n1 - tail);
}

}  // namespace radixserve_kquant
