// The block steps of paged_decode.cpp (a block: kBlock positions of one query, every head):
// scores, the online-softmax rescale, and the weighted V sum, one query head at a time (plain
// loops the compiler vectorizes); paged_decode_grouped.h does a KV head's GQA group of query
// heads together with AVX-512 or AVX2 vectors and picks between the two forms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace radixserve_decode {

using radixserve_cpu::axpy;
using radixserve_cpu::exp_nonpositive;
using radixserve_cpu::kNegInf;
using radixserve_cpu::scale_row;

constexpr int64_t kBlock = 32;         // positions per online-softmax rescale
constexpr int64_t kMinSplitLen = 256;  // a split shorter than this costs more than it saves
constexpr int64_t kLanes = 16;         // floats per accumulator of the score product
constexpr int64_t kKeyTile = 16;       // keys scored together against one query head
constexpr int64_t kPvChunks = 4;       // kLanes-float chunks of a head's output in registers

struct Shape {
  int64_t num_queries, num_heads, num_kv_heads, head_dim, group, page_size, max_pages;
  int64_t window;  // <= 0: none
  float scale;
  float cap;  // > 0: scores soft-capped to cap * tanh(score / cap) (Gemma); else plain
};

// Online-softmax state of one work item: per query head a running max, sum and output;
// kbuf / vbuf the block's K / V rows widened to fp32, for a bf16 pool only (an fp32 pool is
// read in place: zeroing 2 x 64 KB of unused buffers cost a few us a call).
struct State {
  std::vector<float> q, acc, max, sum, scores, kbuf, vbuf;
  State(const Shape& s, bool widens)
      : q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), max(s.num_heads),
        sum(s.num_heads), scores(s.num_heads * kBlock),
        kbuf(widens ? kBlock * s.num_kv_heads * s.head_dim : 0),
        vbuf(widens ? kBlock * s.num_kv_heads * s.head_dim : 0) {}
  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(max.begin(), max.end(), kNegInf);
    std::fill(sum.begin(), sum.end(), 0.f);
  }
};

// A bf16 pool's next block of K / V rows, asked for ahead of their use a KV head's part at a
// time, spread between this block's steps (a long context's pool is out of cache in a decode
// step: the weights pass through between layers). To L2, not L1, where the current block is.
// An fp32 pool's blocks are read in order instead (touch_rows; its Ahead is empty).
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0, row_bytes = 0, head_bytes = 0;

  void fetch(const char* pool, int64_t first_head, int64_t heads) const {
    const int64_t lo = first_head * head_bytes, hi = lo + heads * head_bytes;
    for (int64_t j = 0; j < n; ++j) {
      const char* row = pool + slots[j] * row_bytes;
      for (int64_t i = lo; i < hi; i += 64) __builtin_prefetch(row + i, 0, 2);
    }
  }
};

// Reads the block's n rows of `floats` floats front to back, one load a 64-byte line, and
// keeps nothing: an fp32 pool is read in place, and these loads in order let the hardware
// prefetchers stream K and V ahead, so that the block's compute then runs from cache. (Out
// of cache, 16 x 4,096 positions, one thread: ~25% faster than asking for the next block
// with prefetch instructions, which still pay for a bf16 pool, whose widening pass reads
// the rows in order already.)
inline void touch_rows(const float* const* rows, int64_t n, int64_t floats) {
  uint32_t seen = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(rows[j]);
    for (int64_t i = 0; i < floats; i += 16) seen |= row[i];
    seen |= row[floats - 1];  // the last line of a row that does not start on one
  }
  [[maybe_unused]] volatile uint32_t sink = seen;
}

// sums[i] = the sum of row i's kLanes floats, for kKeyTile = 16 rows. With AVX-512 a
// transposing tree (unpack, shuffle, add: 45 instructions for all 16 rows) instead of one
// horizontal reduction per row, which cost more than the row's dot product itself.
#if defined(__AVX512F__)
inline void sum_rows(const __m512* a, float* sums) {  // a: kKeyTile vectors
  static_assert(kKeyTile == 16 && kLanes == 16, "the tree below sums 16 rows of 16");
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 rows
    const __m512 x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: [c0 half, c0 half, c1 half, c1 half]
    const __m512 x = c[2 * i], y = c[2 * i + 1];
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1))));
}
#endif

inline void sum_rows(const float (&acc)[kKeyTile][kLanes], float* sums) {
#if defined(__AVX512F__)
  __m512 a[kKeyTile];
  for (int i = 0; i < kKeyTile; ++i) a[i] = _mm512_loadu_ps(acc[i]);
  sum_rows(a, sums);
#else
  for (int64_t i = 0; i < kKeyTile; ++i) {
    float sum = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) sum += acc[i][l];
    sums[i] = sum;
  }
#endif
}

// scores[head, j] = q[head] . k[j] for the block's n keys. Per tile of kKeyTile keys and per
// query head, kKeyTile vector accumulators run across head_dim (the query chunk loaded once
// for all the tile's keys) and are reduced together at the end (sum_rows).
inline void score_block(State& st, const Shape& s, const float* const* krows, int64_t n) {
  const int64_t D = s.head_dim, wide = D / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int64_t m = std::min(kKeyTile, n - j0);
    for (int64_t head = 0; head < s.num_heads; ++head) {
      const int64_t off = (head / s.group) * D;
      const float* kr[kKeyTile];  // a short tile repeats its last key: no branch in the loop
      for (int64_t jj = 0; jj < kKeyTile; ++jj) kr[jj] = krows[j0 + std::min(jj, m - 1)] + off;
      const float* qh = st.q.data() + head * D;
      float acc[kKeyTile][kLanes];
      for (int64_t jj = 0; jj < kKeyTile; ++jj) {
        for (int64_t l = 0; l < kLanes; ++l) acc[jj][l] = 0.f;
      }
      for (int64_t d0 = 0; d0 < wide; d0 += kLanes) {
        for (int64_t jj = 0; jj < kKeyTile; ++jj) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[jj][l] += kr[jj][d0 + l] * qh[d0 + l];
        }
      }
      for (int64_t d = wide; d < D; ++d) {  // head_dim not a multiple of kLanes
        for (int64_t jj = 0; jj < kKeyTile; ++jj) acc[jj][0] += kr[jj][d] * qh[d];
      }
      float sums[kKeyTile];
      sum_rows(acc, sums);
      std::copy_n(sums, m, st.scores.data() + head * kBlock + j0);
    }
  }
}

// Online softmax over the block per head (its scores soft-capped first where s.cap > 0): new
// running max, rescale of sum and acc, scores -> weights.
inline void softmax_block(State& st, const Shape& s, int64_t n) {
  for (int64_t head = 0; head < s.num_heads; ++head) {
    float* sc = st.scores.data() + head * kBlock;
    if (s.cap > 0.f) {
      for (int64_t j = 0; j < n; ++j) sc[j] = s.cap * std::tanh(sc[j] / s.cap);
    }
    float new_max = st.max[head];
#if defined(__AVX512F__)
    __m512 most = _mm512_set1_ps(new_max);
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 live = n - j >= kLanes ? 0xFFFF : (1u << (n - j)) - 1;
      most = _mm512_max_ps(most, _mm512_mask_loadu_ps(most, live, sc + j));
    }
    new_max = _mm512_reduce_max_ps(most);
#else
    for (int64_t j = 0; j < n; ++j) new_max = std::max(new_max, sc[j]);
#endif
    const float alpha = std::exp(st.max[head] - new_max);
    st.sum[head] *= alpha;
    scale_row(st.acc.data() + head * s.head_dim, alpha, s.head_dim);
    float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t j = 0; j < n; ++j) {
      sc[j] = exp_nonpositive(sc[j] - new_max);
      block_sum += sc[j];
    }
    st.sum[head] += block_sum;
    st.max[head] = new_max;
  }
}

// acc[head] += sum_j weight[head, j] v[j] over the block's n keys, kPvChunks x kLanes floats
// of a head's output at a time held in registers across the keys (one load and store per
// block, not per key).
inline void value_block(State& st, const Shape& s, const float* const* vrows, int64_t n) {
  const int64_t D = s.head_dim;
  for (int64_t head = 0; head < s.num_heads; ++head) {
    const int64_t off = (head / s.group) * D;
    const float* w = st.scores.data() + head * kBlock;
    float* out = st.acc.data() + head * D;
    int64_t d0 = 0;
    for (; d0 + kPvChunks * kLanes <= D; d0 += kPvChunks * kLanes) {
      float acc[kPvChunks][kLanes];
      for (int64_t c = 0; c < kPvChunks; ++c) std::copy_n(out + d0 + c * kLanes, kLanes, acc[c]);
      for (int64_t j = 0; j < n; ++j) {
        const float* vv = vrows[j] + off + d0;
        for (int64_t c = 0; c < kPvChunks; ++c) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[c][l] += w[j] * vv[c * kLanes + l];
        }
      }
      for (int64_t c = 0; c < kPvChunks; ++c) std::copy_n(acc[c], kLanes, out + d0 + c * kLanes);
    }
    for (int64_t j = 0; j < n && d0 < D; ++j) axpy(out + d0, w[j], vrows[j] + off + d0, D - d0);
  }
}

}  // namespace radixserve_decode
