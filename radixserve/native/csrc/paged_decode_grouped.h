// paged_decode.cpp's block steps with a KV head's GQA group of query heads done together, on
// AVX-512 (`Zmm`, 16-float vectors) or AVX2 (`Ymm`, 8): each K and V chunk is loaded once for
// the whole group, where the per-head form (paged_decode_blocks.h) loads it once per query
// head, and the score accumulators are reduced by a transposing tree instead of one row at a
// time. `attend_rows` picks this form where the build has one of the two and head_dim is
// whole vectors, the per-head form otherwise.
//
// Bits: on AVX-512 the FMAs and their order per output, and the tree, are the per-head form's,
// so the results are its bit for bit. On AVX2 a score's products are summed 8 lanes at a time
// (the per-head form's loops sum 16), so the last bits may differ from the per-head form's;
// both are within the tests' tolerance of the reference.
#pragma once

#include "paged_decode_blocks.h"

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_decode {

#if defined(__AVX512F__)
#define RADIXSERVE_DECODE_GROUPED 1
struct Zmm {
  using V = __m512;
  static constexpr int kWidth = 16;       // floats a vector
  static constexpr int kTree = kKeyTile;  // score accumulators reduced together (sum_rows)
  static constexpr int kMaxAcc = kKeyTile;  // score accumulators a tile of keys, at most
  // output chunks a head holds in registers across a block's keys: at most 16 accumulators
  static constexpr int chunks(int group) { return group <= 4 ? 4 : 2; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void sum_tree(const V* a, float* sums) { sum_rows(a, sums); }
};
using Wide = Zmm;
#elif defined(__AVX2__) && defined(__FMA__)
#define RADIXSERVE_DECODE_GROUPED 1
struct Ymm {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kTree = 8;
  static constexpr int kMaxAcc = 12;  // with G query chunks and a key chunk: 16 registers
  // 16 registers: group x chunks accumulators, the chunks of V, one broadcast weight
  static constexpr int chunks(int group) { return group <= 2 ? 4 : group <= 4 ? 2 : 1; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // sums[i] = the sum of a[i]'s 8 lanes (8 vectors at a): pairs and quads by hadd (rows 0-3
  // | 4-7 per 128-bit half), then the halves' quads added: 7 instructions for 8 rows.
  static void sum_tree(const V* a, float* sums) {
    const V q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const V q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                                         _mm256_permute2f128_ps(q0, q1, 0x31)));
  }
};
using Wide = Ymm;
#endif

#if defined(RADIXSERVE_DECODE_GROUPED)
// Scores of one KV head's G query heads (q: [G, D], scores: head stride kBlock) against the
// block's n keys, kMaxAcc / G keys a tile: each key's chunk is loaded once and multiplied into
// the G heads' accumulators, reduced kTree at a time by the tree at the end.
template <typename S, int G>
void score_group(const float* q, const float* const* krows, int64_t off, int64_t D, int64_t n,
                 float* scores) {
  constexpr int kKeys = S::kMaxAcc / G;
  constexpr int kSlots = (G * kKeys + S::kTree - 1) / S::kTree * S::kTree;
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t m = std::min<int64_t>(kKeys, n - j0);
    const float* kr[kKeys];  // a short tile repeats its last key
    for (int jj = 0; jj < kKeys; ++jj) kr[jj] = krows[j0 + std::min<int64_t>(jj, m - 1)] + off;
    typename S::V acc[kSlots];
    for (int i = 0; i < kSlots; ++i) acc[i] = S::zero();
    for (int64_t d0 = 0; d0 < D; d0 += S::kWidth) {
      typename S::V qv[G];
      for (int g = 0; g < G; ++g) qv[g] = S::load(q + g * D + d0);
      for (int jj = 0; jj < kKeys; ++jj) {
        const typename S::V kv = S::load(kr[jj] + d0);
        for (int g = 0; g < G; ++g) acc[g * kKeys + jj] = S::fma(kv, qv[g], acc[g * kKeys + jj]);
      }
    }
    float sums[kSlots];
    for (int t = 0; t < kSlots; t += S::kTree) S::sum_tree(acc + t, sums + t);
    for (int g = 0; g < G; ++g) std::copy_n(sums + g * kKeys, m, scores + g * kBlock + j0);
  }
}

// out[g] += sum_j w[g, j] v[j] for one KV head's G query heads (w: head stride kBlock, out:
// head stride D), C chunks of each head's output held in registers across the block's keys;
// each V chunk is loaded once for the G heads.
template <typename S, int G, int C>
void value_chunks(const float* w, const float* const* vrows, int64_t off, int64_t D, int64_t n,
                  float* out, int64_t d0) {
  typename S::V acc[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) acc[g][c] = S::load(out + g * D + d0 + c * S::kWidth);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vv = vrows[j] + off + d0;
    typename S::V vc[C];
    for (int c = 0; c < C; ++c) vc[c] = S::load(vv + c * S::kWidth);
    for (int g = 0; g < G; ++g) {
      const typename S::V wb = S::set1(w[g * kBlock + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = S::fma(wb, vc[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) S::store(out + g * D + d0 + c * S::kWidth, acc[g][c]);
  }
}

template <typename S, int G>
void value_group(const float* w, const float* const* vrows, int64_t off, int64_t D, int64_t n,
                 float* out) {
  constexpr int C = S::chunks(G);
  int64_t d0 = 0;
  for (; d0 + C * S::kWidth <= D; d0 += C * S::kWidth) {
    value_chunks<S, G, C>(w, vrows, off, D, n, out, d0);
  }
  for (; d0 < D; d0 += S::kWidth) value_chunks<S, G, 1>(w, vrows, off, D, n, out, d0);
}

// The block's scores, softmax and V sum, a KV head's group of G query heads at a time.
template <int G>
void attend_grouped(State& st, const Shape& s, const float* const* krows,
                    const float* const* vrows, int64_t n, const Ahead& ahead) {
  const int64_t D = s.head_dim;
  for (int64_t h = 0; h < s.num_kv_heads; ++h) {
    ahead.fetch(ahead.k, h, 1);
    score_group<Wide, G>(st.q.data() + h * G * D, krows, h * D, D, n,
                         st.scores.data() + h * G * kBlock);
  }
  softmax_block(st, s, n);
  for (int64_t h = 0; h < s.num_kv_heads; ++h) {
    ahead.fetch(ahead.v, h, 1);
    value_group<Wide, G>(st.scores.data() + h * G * kBlock, vrows, h * D, D, n,
                         st.acc.data() + h * G * D);
  }
}
#endif

// The block's scores, softmax and V sum for every head: grouped where the build and shape
// allow, per head otherwise.
inline void attend_rows(State& st, const Shape& s, const float* const* krows,
                        const float* const* vrows, int64_t n, const Ahead& ahead) {
#if defined(RADIXSERVE_DECODE_GROUPED)
  if (s.head_dim % Wide::kWidth == 0) {
    switch (s.group) {
      case 1: return attend_grouped<1>(st, s, krows, vrows, n, ahead);
      case 2: return attend_grouped<2>(st, s, krows, vrows, n, ahead);
      case 3: return attend_grouped<3>(st, s, krows, vrows, n, ahead);
      case 4: return attend_grouped<4>(st, s, krows, vrows, n, ahead);
      case 5: return attend_grouped<5>(st, s, krows, vrows, n, ahead);
      case 6: return attend_grouped<6>(st, s, krows, vrows, n, ahead);
      case 7: return attend_grouped<7>(st, s, krows, vrows, n, ahead);
      case 8: return attend_grouped<8>(st, s, krows, vrows, n, ahead);
      default: break;
    }
  }
#endif
  ahead.fetch(ahead.k, 0, s.num_kv_heads);
  ahead.fetch(ahead.v, 0, s.num_kv_heads);
  score_block(st, s, krows, n);
  softmax_block(st, s, n);
  value_block(st, s, vrows, n);
}

}  // namespace radixserve_decode
