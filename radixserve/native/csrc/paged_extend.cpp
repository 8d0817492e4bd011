// Paged extend attention for CPU: a request's new tokens (a cache-hit prefill, a chunk after
// the first, a speculative verify) attend to its cached prefix and to each other, causally,
// with K/V read in place from the paged pool through its page-table row (no gathered copy,
// no mask tensor). The caller has already written the new tokens' K/V to the pool.
//
// Work item = (request, KV head, tile of new tokens): the tile's tokens x the KV head's GQA
// group of query heads are the rows of one query block Q [rows, head_dim], kept transposed
// (Qt [head_dim, rows]) so that scoring a key is an outer product over rows. Keys go in
// blocks of kKeys positions: S = K_block Q^T by an 8-key x 16-row register tile, the causal
// / window mask only on blocks that cross a row's limit, one online-softmax rescale per
// block (vectorized exp), then O += P V by a 4-row x 16-dim register tile. Each K/V row is
// loaded once per tile of new tokens, not once per token.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace {

using radixserve_cpu::check_q_pools_and_table;
using radixserve_cpu::exp_nonpositive;
using radixserve_cpu::kNegInf;
using radixserve_cpu::row_f32;

constexpr int64_t kKeys = 64;      // key positions per online-softmax rescale
constexpr int64_t kTileRows = 64;  // query rows (tokens x GQA heads) per work item, at most
constexpr int64_t kLanes = 16;     // rows per register tile of the score product
constexpr int64_t kKeyTile = 8;    // keys per register tile of the score product
constexpr int64_t kPvRows = 4;     // rows per register tile of the P V product

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, group, page_size, max_pages;
  int64_t window;  // <= 0: none
  float scale;
};

struct Item {
  int64_t req, kv_head, first, num_tokens;  // the tile: new tokens [first, first + num_tokens)
};

// Per-thread buffers of one work item; rows padded to a multiple of kLanes (padding rows
// repeat the last real row's position, so they never produce NaN, and are not written out).
struct Tile {
  int64_t rows = 0, padded = 0;
  std::vector<float> qt, scores, acc, max, sum, ref, alpha;
  std::vector<int64_t> qpos;
  std::vector<float> kbuf, vbuf;
  std::vector<const float*> krows, vrows;
  explicit Tile(const Shape& s) {
    const int64_t most = (kTileRows + kLanes - 1) / kLanes * kLanes, d = s.head_dim;
    qt.resize(d * most);
    scores.resize(kKeys * most);
    acc.resize(most * d);
    max.resize(most), sum.resize(most), ref.resize(most), alpha.resize(most);
    qpos.resize(most);
    kbuf.resize(kKeys * d), vbuf.resize(kKeys * d);
    krows.resize(kKeys), vrows.resize(kKeys);
  }
};

// S[j, m] = sum_d K[j, d] * Qt[d, m] for j < n, all padded rows m.
void score_block(Tile& t, int64_t n, int64_t dim) {
  const int64_t P = t.padded;
  for (int64_t m0 = 0; m0 < P; m0 += kLanes) {
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
      const float* kr[kKeyTile];
      for (int64_t jj = 0; jj < kKeyTile; ++jj) kr[jj] = t.krows[std::min(j0 + jj, n - 1)];
      float acc[kKeyTile][kLanes] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const float* qv = t.qt.data() + d * P + m0;
        for (int64_t jj = 0; jj < kKeyTile; ++jj) {
          const float kd = kr[jj][d];
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[jj][l] += kd * qv[l];
        }
      }
      for (int64_t jj = 0; jj < std::min(kKeyTile, n - j0); ++jj) {
        std::copy(acc[jj], acc[jj] + kLanes, t.scores.data() + (j0 + jj) * P + m0);
      }
    }
  }
}

// -inf where key position b + j is after a row's position or outside its window.
void mask_block(Tile& t, int64_t b, int64_t n, int64_t window) {
  const int64_t P = t.padded;
  for (int64_t j = 0; j < n; ++j) {
    float* s = t.scores.data() + j * P;
    const int64_t key = b + j;
#pragma omp simd
    for (int64_t m = 0; m < P; ++m) {
      const bool out = key > t.qpos[m] || (window > 0 && key <= t.qpos[m] - window);
      s[m] = out ? kNegInf : s[m];
    }
  }
}

// Online softmax over the block: new running max, rescale of sum and acc, S -> weights.
void softmax_block(Tile& t, int64_t n, int64_t dim) {
  const int64_t P = t.padded;
  std::vector<float>& mx = t.max;
  for (int64_t m = 0; m < P; ++m) t.ref[m] = mx[m];
  for (int64_t j = 0; j < n; ++j) {
    const float* s = t.scores.data() + j * P;
#pragma omp simd
    for (int64_t m = 0; m < P; ++m) t.ref[m] = std::max(t.ref[m], s[m]);
  }
#pragma omp simd
  for (int64_t m = 0; m < P; ++m) {
    const float new_max = t.ref[m];
    t.ref[m] = new_max == kNegInf ? 0.f : new_max;  // a row masked so far: weights stay 0
    t.alpha[m] = exp_nonpositive(mx[m] - t.ref[m]);
    mx[m] = new_max;
    t.sum[m] *= t.alpha[m];
  }
  for (int64_t j = 0; j < n; ++j) {
    float* s = t.scores.data() + j * P;
#pragma omp simd
    for (int64_t m = 0; m < P; ++m) {
      s[m] = exp_nonpositive(s[m] - t.ref[m]);
      t.sum[m] += s[m];
    }
  }
  for (int64_t m = 0; m < t.rows; ++m) {
    if (t.alpha[m] == 1.f) continue;
    float* a = t.acc.data() + m * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) a[d] *= t.alpha[m];
  }
}

// acc[m, :] += sum_j S[j, m] * V[j, :], for the real rows (rounded up to kPvRows: a decode's
// few rows do not pay for 16); each row's sum runs alone, so skipping padding changes none.
void value_block(Tile& t, int64_t n, int64_t dim) {
  const int64_t P = t.padded, wide = dim / kLanes * kLanes;
  const int64_t rows = (t.rows + kPvRows - 1) / kPvRows * kPvRows;
  for (int64_t m0 = 0; m0 < rows; m0 += kPvRows) {
    for (int64_t d0 = 0; d0 < wide; d0 += kLanes) {
      float acc[kPvRows][kLanes];
      for (int64_t r = 0; r < kPvRows; ++r) {
        std::copy_n(t.acc.data() + (m0 + r) * dim + d0, kLanes, acc[r]);
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* vv = t.vrows[j] + d0;
        const float* p = t.scores.data() + j * P + m0;
        for (int64_t r = 0; r < kPvRows; ++r) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += p[r] * vv[l];
        }
      }
      for (int64_t r = 0; r < kPvRows; ++r) {
        std::copy_n(acc[r], kLanes, t.acc.data() + (m0 + r) * dim + d0);
      }
    }
    for (int64_t r = 0; r < kPvRows && wide < dim; ++r) {  // head_dim not a multiple of 16
      float* a = t.acc.data() + (m0 + r) * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float p = t.scores[j * P + m0 + r];
        for (int64_t d = wide; d < dim; ++d) a[d] += p * t.vrows[j][d];
      }
    }
  }
}

// Loads the item's query rows (row m = token m / group, head kv_head * group + m % group),
// scaled, into Qt and resets the softmax state.
void load_tile(Tile& t, const Shape& s, const float* q, int64_t q_start, int64_t prefix,
               const Item& it) {
  const int64_t D = s.head_dim, H = s.num_heads, G = s.group;
  t.rows = it.num_tokens * G;
  t.padded = (t.rows + kLanes - 1) / kLanes * kLanes;
  std::fill(t.qt.begin(), t.qt.begin() + D * t.padded, 0.f);
  for (int64_t m = 0; m < t.rows; ++m) {
    const int64_t token = it.first + m / G, head = it.kv_head * G + m % G;
    const float* src = q + ((q_start + token) * H + head) * D;
    for (int64_t d = 0; d < D; ++d) t.qt[d * t.padded + m] = src[d] * s.scale;
  }
  for (int64_t m = 0; m < t.padded; ++m) {
    t.qpos[m] = prefix + it.first + std::min(m, t.rows - 1) / G;
  }
  std::fill(t.acc.begin(), t.acc.begin() + t.padded * D, 0.f);
  std::fill(t.max.begin(), t.max.end(), kNegInf);
  std::fill(t.sum.begin(), t.sum.end(), 0.f);
}

template <typename T>
void attend_item(Tile& t, const Shape& s, const T* k, const T* v, const int64_t* page_row,
                 int64_t kv_head) {
  const int64_t D = s.head_dim, span = s.num_kv_heads * D;
  const int64_t first_pos = t.qpos[0], last_pos = t.qpos[t.padded - 1];
  // Blocks start at multiples of kKeys, whatever the tile: a row's blocks (and so its sums'
  // order) are then the same alone or beside any rows; blocks a row does not see leave it as
  // it was (weight 0, rescale 1).
  const int64_t lo =
      s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) / kKeys * kKeys : 0;
  for (int64_t b = lo; b <= last_pos; b += kKeys) {
    const int64_t n = std::min(kKeys, last_pos + 1 - b);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = b + j;
      const int64_t slot = page_row[pos / s.page_size] * s.page_size + pos % s.page_size;
      const int64_t off = slot * span + kv_head * D;
      t.krows[j] = row_f32(k + off, t.kbuf.data() + j * D, D);
      t.vrows[j] = row_f32(v + off, t.vbuf.data() + j * D, D);
    }
    score_block(t, n, D);
    const bool crosses = b + n - 1 > first_pos || (s.window > 0 && b <= last_pos - s.window);
    if (crosses) mask_block(t, b, n, s.window);
    softmax_block(t, n, D);
    value_block(t, n, D);
  }
}

// Writes the item's normalized rows to out (request r's tokens start at out_start).
void store_tile(const Tile& t, const Shape& s, const Item& it, int64_t out_start, float* out) {
  const int64_t D = s.head_dim, G = s.group;
  for (int64_t m = 0; m < t.rows; ++m) {
    const int64_t token = it.first + m / G, head = it.kv_head * G + m % G;
    float* dst = out + ((out_start + token) * s.num_heads + head) * D;
    const float inv = 1.f / t.sum[m];
    for (int64_t d = 0; d < D; ++d) dst[d] = t.acc[m * D + d] * inv;
  }
}

struct Requests {
  const int64_t *q_starts, *prefix_lens, *extend_lens, *page_rows;
  std::vector<int64_t> out_starts;  // each request's first row of the output
};

template <typename T>
void run(const Shape& s, const Requests& reqs, const std::vector<Item>& items, const float* q,
         const T* k, const T* v, const int64_t* page_table, float* out) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Tile t(s);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t r = it.req, prefix = reqs.prefix_lens[r];
      load_tile(t, s, q, reqs.q_starts[r], prefix, it);
      const int64_t* row = page_table + reqs.page_rows[r] * s.max_pages;
      attend_item(t, s, k, v, row, it.kv_head);
      store_tile(t, s, it, reqs.out_starts[r], out);
    }
  });
}

void check_requests(const at::Tensor& q, const at::Tensor& page_table, const Requests& reqs,
                    int64_t num_reqs, int64_t page_size, int64_t num_pages) {
  const int64_t max_pages = page_table.size(1);
  const int64_t* pt = page_table.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t start = reqs.q_starts[r], ext = reqs.extend_lens[r], row = reqs.page_rows[r];
    const int64_t len = reqs.prefix_lens[r] + ext;
    TORCH_CHECK(ext >= 1 && reqs.prefix_lens[r] >= 0, "request ", r,
                ": extend_lens must be >= 1 and prefix_lens >= 0");
    TORCH_CHECK(start >= 0 && start + ext <= q.size(0), "request ", r,
                ": q_starts + extend_lens runs past q's rows");
    TORCH_CHECK(row >= 0 && row < page_table.size(0), "page_rows[", r, "] = ", row,
                " is not a row of page_table");
    TORCH_CHECK(len <= max_pages * page_size, "request ", r, ": prefix_lens + extend_lens = ",
                len, " is more than page_table width * page_size");
    for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p) {
      const int64_t page = pt[row * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page_table[", row, ", ", p, "] = ", page,
                  " is not a page of the pool");
    }
  }
}

void check_tensors(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& page_table, const std::vector<at::Tensor>& per_request) {
  check_q_pools_and_table(q, k_pool, v_pool, page_table, "paged_extend");
  for (const at::Tensor& x : per_request) {
    TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kLong && x.is_contiguous() &&
                    x.size(0) == per_request[0].size(0),
                "q_starts, prefix_lens, extend_lens and page_rows must be contiguous int64 "
                "[num_reqs] tensors");
  }
}

// Work items: each request's new tokens in tiles of equal size (at most kTileRows rows, so a
// 64-token extend with 3 heads per KV head is 4 tiles of 16, not 3 of 21 and one of 1),
// times its KV heads.
std::vector<Item> make_items(const Requests& reqs, int64_t num_reqs, const Shape& s) {
  const int64_t most = std::max<int64_t>(1, kTileRows / s.group);
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t ext = reqs.extend_lens[r], num_tiles = (ext + most - 1) / most;
    const int64_t size = (ext + num_tiles - 1) / num_tiles;
    for (int64_t first = 0; first < ext; first += size) {
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        items.push_back({r, h, first, std::min(size, ext - first)});
      }
    }
  }
  return items;
}

at::Tensor paged_extend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& page_table, const at::Tensor& q_starts,
                        const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                        const at::Tensor& page_rows, int64_t page_size, int64_t sliding_window,
                        double scale) {
  check_tensors(q, k_pool, v_pool, page_table, {q_starts, prefix_lens, extend_lens, page_rows});
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1");
  const int64_t num_reqs = q_starts.size(0), group = q.size(1) / k_pool.size(1);
  Requests reqs{q_starts.data_ptr<int64_t>(), prefix_lens.data_ptr<int64_t>(),
                extend_lens.data_ptr<int64_t>(), page_rows.data_ptr<int64_t>(), {}};
  check_requests(q, page_table, reqs, num_reqs, page_size, k_pool.size(0) / page_size);
  Shape s{q.size(1), k_pool.size(1), q.size(2), group, page_size, page_table.size(1),
          sliding_window, static_cast<float>(scale)};
  std::vector<Item> items = make_items(reqs, num_reqs, s);
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    reqs.out_starts.push_back(total);
    total += reqs.extend_lens[r];
  }
  at::Tensor out = at::empty({total, s.num_heads, s.head_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  if (k_pool.scalar_type() == at::kFloat) {
    run(s, reqs, items, qp, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), pt, op);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16, "the pool must be float32 or bfloat16");
    run(s, reqs, items, qp, k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(),
        pt, op);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("paged_extend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor page_table, "
        "Tensor q_starts, Tensor prefix_lens, Tensor extend_lens, Tensor page_rows, "
        "int page_size, int sliding_window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("paged_extend", &paged_extend); }
