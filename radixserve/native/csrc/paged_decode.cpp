// Fused paged decode attention for CPU: each query token attends to the first seq_len
// positions of its page-table row, K/V read in place from the paged pool (no gathered copy,
// no padding, no mask tensor). A query is a decode token (seq_len: its request's length) or
// a token of an extend over a cached prefix (seq_len: its position + 1, page_rows naming its
// request's row), whose K/V the caller has already written to the pool.
//
// Work item = (query, split of positions), all heads together: a position's K/V of every
// KV head is one contiguous run of the pool, read front to back (a page holds page_size such
// runs back to back), and each KV row is scored against its GQA group of query heads.
// Positions go in blocks of kBlock: scores for the block, one online-softmax rescale, then
// the weighted V sum. Scores: per query head, a tile of 16 keys accumulates in 16 vectors
// across head_dim, reduced together at the end (sum_rows); V sum: 64 floats of a head's output
// held in registers across the block's keys. When there are fewer queries than threads,
// positions are split and the splits' partial results merged by their log-sum-exp
// (num_splits > 0 forces a split count, for tests and benchmarks). Plain loops that -O3 and
// `omp simd` vectorize for whatever SIMD width the build flags allow, except sum_rows' AVX-512
// reduction tree (a plain-loop fallback elsewhere).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using radixserve_cpu::axpy;
using radixserve_cpu::check_q_pools_and_table;
using radixserve_cpu::exp_nonpositive;
using radixserve_cpu::kNegInf;
using radixserve_cpu::row_f32;
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

// sums[i] = the sum of row i's kLanes floats, for kKeyTile = 16 rows. With AVX-512 a
// transposing tree (unpack, shuffle, add: 45 instructions for all 16 rows) instead of one
// horizontal reduction per row, which cost more than the row's dot product itself.
inline void sum_rows(const float (&acc)[kKeyTile][kLanes], float* sums) {
#if defined(__AVX512F__)
  static_assert(kKeyTile == 16 && kLanes == 16, "the tree below sums 16 rows of 16");
  __m512 a[16], b[8], c[4], d[2];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(acc[i]);
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
void score_block(State& st, const Shape& s, const float* const* krows, int64_t n) {
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
void softmax_block(State& st, const Shape& s, int64_t n) {
  for (int64_t head = 0; head < s.num_heads; ++head) {
    float* sc = st.scores.data() + head * kBlock;
    if (s.cap > 0.f) {
      for (int64_t j = 0; j < n; ++j) sc[j] = s.cap * std::tanh(sc[j] / s.cap);
    }
    float new_max = st.max[head];
    for (int64_t j = 0; j < n; ++j) new_max = std::max(new_max, sc[j]);
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

// acc[head] += sum_j weight[head, j] v[j] over the block's n keys, kPvChunks x kLanes floats of a
// head's output at a time held in registers across the keys (one load and store per block, not per key).
void value_block(State& st, const Shape& s, const float* const* vrows, int64_t n) {
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

// One block of n positions for every head. A position's K (and V) of all KV heads is one
// contiguous [num_kv_heads, head_dim] run of the pool (bf16 runs widened into the buffers).
template <typename T>
void attend_block(State& st, const Shape& s, const T* k, const T* v, const int64_t* slots,
                  int64_t n) {
  const int64_t span = s.num_kv_heads * s.head_dim;
  const float* krows[kBlock];
  const float* vrows[kBlock];
  for (int64_t j = 0; j < n; ++j) {
    krows[j] = row_f32(k + slots[j] * span, st.kbuf.data() + j * span, span);
    vrows[j] = row_f32(v + slots[j] * span, st.vbuf.data() + j * span, span);
  }
  score_block(st, s, krows, n);
  softmax_block(st, s, n);
  value_block(st, s, vrows, n);
}

// Attends positions [lo, hi) for query r; leaves the unnormalized state in `st`.
template <typename T>
void attend_range(State& st, const Shape& s, const float* q, const T* k, const T* v,
                  const int64_t* page_row, int64_t r, int64_t lo, int64_t hi) {
  const int64_t width = s.num_heads * s.head_dim;
  const float* src = q + r * width;
  for (int64_t i = 0; i < width; ++i) st.q[i] = src[i] * s.scale;
  st.reset();
  int64_t slots[kBlock];
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t n = std::min(kBlock, hi - b);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = b + j;
      slots[j] = page_row[pos / s.page_size] * s.page_size + pos % s.page_size;
    }
    attend_block(st, s, k, v, slots, n);
  }
}

int64_t choose_splits(const Shape& s, int64_t max_len) {
  const int64_t items = s.num_queries;
  const int64_t threads = at::get_num_threads();
  if (items >= threads) return 1;
  const int64_t wanted = (2 * threads + items - 1) / items;
  const int64_t most = std::max<int64_t>(1, max_len / kMinSplitLen);
  return std::min(wanted, most);
}

template <typename T>
at::Tensor run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& page_table, const int64_t* page_rows,
               const at::Tensor& seq_lens, const Shape& s, int64_t num_splits) {
  const int64_t D = s.head_dim;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_len = *std::max_element(lens, lens + s.num_queries);
  const int64_t splits = num_splits > 0 ? std::min(num_splits, max_len) : choose_splits(s, max_len);
  const int64_t split_len = ((max_len + splits - 1) / splits + kBlock - 1) / kBlock * kBlock;
  const int64_t num_items = s.num_queries * splits;
  const int64_t width = s.num_heads * D;  // one query's output

  at::Tensor out = at::empty({s.num_queries, s.num_heads, D}, q.options());
  // splits > 1: each split's unnormalized output, max and sum per head; merged below
  std::vector<float> part_acc(splits > 1 ? num_items * width : 0);
  std::vector<float> part_max(splits > 1 ? num_items * s.num_heads : 0);
  std::vector<float> part_sum(splits > 1 ? num_items * s.num_heads : 0);

  const float* qp = q.data_ptr<float>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    State st(s, !std::is_same_v<T, float>);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / splits, split = item % splits, len = lens[r];
      int64_t lo = split * split_len, hi = std::min(len, lo + split_len);
      if (s.window > 0) lo = std::max(lo, len - s.window);
      if (lo < hi) {
        const int64_t row = page_rows != nullptr ? page_rows[r] : r;
        attend_range(st, s, qp, kp, vp, pt + row * s.max_pages, r, lo, hi);
      } else {
        st.reset();
      }
      if (splits == 1) {
        for (int64_t head = 0; head < s.num_heads; ++head) {
          const float inv = 1.f / st.sum[head];
          float* dst = op + r * width + head * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = st.acc[head * D + d] * inv;
        }
      } else {
        std::copy(st.acc.begin(), st.acc.end(), part_acc.begin() + item * width);
        std::copy(st.max.begin(), st.max.end(), part_max.begin() + item * s.num_heads);
        std::copy(st.sum.begin(), st.sum.end(), part_sum.begin() + item * s.num_heads);
      }
    }
  });
  if (splits == 1) return out;

  // Log-sum-exp merge: weight each split by exp(its max - the overall max).
  at::parallel_for(0, s.num_queries * s.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / s.num_heads, head = rh % s.num_heads;
      float m = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) {
        m = std::max(m, part_max[(r * splits + sp) * s.num_heads + head]);
      }
      float* dst = op + rh * D;
      std::fill(dst, dst + D, 0.f);
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t i = (r * splits + sp) * s.num_heads + head;
        if (part_sum[i] == 0.f) continue;  // an empty split
        const float w = std::exp(part_max[i] - m);
        total += part_sum[i] * w;
        axpy(dst, w, part_acc.data() + (r * splits + sp) * width + head * D, D);
      }
      scale_row(dst, 1.f / total, D);
    }
  });
  return out;
}

void check_pages(const at::Tensor& page_table, const int64_t* page_rows, const int64_t* lens,
                 int64_t num_queries, int64_t page_size, int64_t num_pages) {
  const int64_t num_rows = page_table.size(0), max_pages = page_table.size(1);
  std::vector<int64_t> row_len(num_rows, 0);  // the longest seq_len read through each row
  for (int64_t r = 0; r < num_queries; ++r) {
    const int64_t row = page_rows != nullptr ? page_rows[r] : r;
    TORCH_CHECK(row >= 0 && row < num_rows, "page_rows[", r, "] = ", row, " is not a row");
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= max_pages * page_size, "seq_lens[", r, "] = ",
                lens[r], " is outside [1, page_table width * page_size]");
    row_len[row] = std::max(row_len[row], lens[r]);
  }
  const int64_t* pt = page_table.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    for (int64_t p = 0; p < (row_len[row] + page_size - 1) / page_size; ++p) {
      const int64_t page = pt[row * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page_table[", row, ", ", p, "] = ", page,
                  " is not a page of the pool");
    }
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& page_table, const std::optional<at::Tensor>& page_rows,
                  const at::Tensor& seq_lens, int64_t page_size) {
  check_q_pools_and_table(q, k_pool, v_pool, page_table, "paged_decode");
  if (page_rows.has_value()) {
    TORCH_CHECK(page_rows->dim() == 1 && page_rows->scalar_type() == at::kLong &&
                    page_rows->is_contiguous() && page_rows->size(0) == q.size(0),
                "page_rows must be a contiguous int64 [num_queries] tensor");
  } else {
    TORCH_CHECK(page_table.size(0) == q.size(0), "without page_rows, page_table needs a row "
                "per query");
  }
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == q.size(0),
              "seq_lens must be a contiguous int64 [num_queries] tensor");
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1");
  const int64_t* rows = page_rows.has_value() ? page_rows->data_ptr<int64_t>() : nullptr;
  check_pages(page_table, rows, seq_lens.data_ptr<int64_t>(), q.size(0), page_size,
              k_pool.size(0) / page_size);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& page_table, const at::Tensor& seq_lens,
                        int64_t page_size, int64_t sliding_window, double scale,
                        int64_t num_splits, const std::optional<at::Tensor>& page_rows,
                        double logit_cap) {
  check_inputs(q, k_pool, v_pool, page_table, page_rows, seq_lens, page_size);
  Shape s{q.size(0), q.size(1), k_pool.size(1), q.size(2), q.size(1) / k_pool.size(1),
          page_size, page_table.size(1), sliding_window, static_cast<float>(scale),
          static_cast<float>(logit_cap)};
  if (s.num_queries == 0) return at::empty(q.sizes(), q.options());
  const int64_t* rows = page_rows.has_value() ? page_rows->data_ptr<int64_t>() : nullptr;
  if (k_pool.scalar_type() == at::kFloat) {
    return run<float>(q, k_pool, v_pool, page_table, rows, seq_lens, s, num_splits);
  }
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16, "the pool must be float32 or bfloat16");
  return run<c10::BFloat16>(q, k_pool, v_pool, page_table, rows, seq_lens, s, num_splits);
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor page_table, "
        "Tensor seq_lens, int page_size, int sliding_window, float scale, "
        "int num_splits=0, Tensor? page_rows=None, float logit_cap=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
