// Fused paged decode attention for CPU: each query token attends to the first seq_len
// positions of its page-table row, K/V read in place from the paged pool (no gathered copy,
// no padding, no mask tensor). A query is a decode token (seq_len: its request's length) or
// a token of an extend over a cached prefix (seq_len: its position + 1, page_rows naming its
// request's row), whose K/V the caller has already written to the pool.
//
// Work item = (query, split of positions), all heads together: a position's K/V of every
// KV head is one contiguous run of the pool, read front to back (a page holds page_size such
// runs back to back), and each KV row is scored against its GQA group of query heads.
// Positions go in blocks of kBlock (paged_decode_blocks.h): scores for the block, one
// online-softmax rescale, then the weighted V sum; a KV head's GQA group of query heads is
// done together where the build (AVX-512 or AVX2) and head_dim allow
// (paged_decode_grouped.h). Slots are walked page by page. An fp32
// block's rows are first read front to back (the hardware prefetchers then stream them); for
// a bf16 pool the next block's rows are prefetched a KV head's part at a time between this
// block's steps (16 x 4,096 positions, SmolLM2's heads, one thread, pool out of cache, fp32
// on an AMD EPYC: prefetching 8.8 ms, reading in order first 6.9). When there are fewer
// queries than threads, positions are split and the splits' partial results merged by their
// log-sum-exp (num_splits > 0 forces a split count, for tests and benchmarks).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"
#include "paged_decode_grouped.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using radixserve_cpu::axpy;
using radixserve_cpu::check_q_pools_and_table;
using radixserve_cpu::kNegInf;
using radixserve_cpu::row_f32;
using radixserve_cpu::scale_row;
using radixserve_decode::Ahead;
using radixserve_decode::attend_rows;
using radixserve_decode::kBlock;
using radixserve_decode::kMinSplitLen;
using radixserve_decode::Shape;
using radixserve_decode::State;
using radixserve_decode::touch_rows;

// One block of n positions for every head. A position's K (and V) of all KV heads is one
// contiguous [num_kv_heads, head_dim] run of the pool: fp32 runs are read in place, first
// front to back (touch_rows), bf16 runs widened into the buffers with the next block's rows
// fetched meanwhile.
template <typename T>
void attend_block(State& st, const Shape& s, const T* k, const T* v, const int64_t* slots,
                  int64_t n, const Ahead& ahead) {
  const int64_t span = s.num_kv_heads * s.head_dim;
  const float* krows[kBlock];
  const float* vrows[kBlock];
  for (int64_t j = 0; j < n; ++j) {
    krows[j] = row_f32(k + slots[j] * span, st.kbuf.data() + j * span, span);
    vrows[j] = row_f32(v + slots[j] * span, st.vbuf.data() + j * span, span);
  }
  if constexpr (std::is_same_v<T, float>) {
    touch_rows(krows, n, span);
    touch_rows(vrows, n, span);
    attend_rows(st, s, krows, vrows, n, Ahead{});
  } else {
    attend_rows(st, s, krows, vrows, n, ahead);
  }
}

// Slots of positions [b, b + n) of a page-table row, walked page by page (no division per
// position).
inline void block_slots(const Shape& s, const int64_t* page_row, int64_t b, int64_t n,
                        int64_t* slots) {
  int64_t page = b / s.page_size, in_page = b % s.page_size;
  int64_t base = page_row[page] * s.page_size;
  for (int64_t j = 0; j < n; ++j) {
    slots[j] = base + in_page;
    if (++in_page == s.page_size && j + 1 < n) {
      in_page = 0;
      base = page_row[++page] * s.page_size;
    }
  }
}

// Attends positions [lo, hi) for query r; leaves the unnormalized state in `st`.
template <typename T>
void attend_range(State& st, const Shape& s, const float* q, const T* k, const T* v,
                  const int64_t* page_row, int64_t r, int64_t lo, int64_t hi) {
  const int64_t width = s.num_heads * s.head_dim;
  const float* src = q + r * width;
  for (int64_t i = 0; i < width; ++i) st.q[i] = src[i] * s.scale;
  st.reset();
  int64_t slots[2][kBlock];
  constexpr int64_t bytes = sizeof(T);
  Ahead ahead{reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v), nullptr, 0,
              s.num_kv_heads * s.head_dim * bytes, s.head_dim * bytes};
  int64_t n = std::min(kBlock, hi - lo);
  block_slots(s, page_row, lo, n, slots[0]);
  for (int64_t b = lo, cur = 0; b < hi; b += kBlock, cur ^= 1) {
    ahead.n = std::min(kBlock, hi - b - n);
    if (ahead.n > 0) block_slots(s, page_row, b + n, ahead.n, slots[cur ^ 1]);
    ahead.slots = slots[cur ^ 1];
    attend_block(st, s, k, v, slots[cur], n, ahead);
    n = ahead.n;
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
