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
//
// Draft trees (speculative verification, optional `tree_parents`): a request whose new tokens
// are not a chain attends as each token's root-to-token path would as a plain sequence. Token
// i sits at logical position prefix + depth(i); blocks below the prefix's last whole block are
// shared by the tile's rows as for a chain, then each token's rows move to a tile of their own
// for its own key list (the rest of the prefix, then its ancestors and itself at positions
// prefix + 0 .. depth), so every row sums the same blocks in the same order as the path's last
// token would in a chain (bitwise: --enable-deterministic-inference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "common.h"
#include "paged_extend_blocks.h"

namespace {

using radixserve_cpu::check_q_pools_and_table;
using radixserve_cpu::row_f32;
using namespace radixserve_extend;  // NOLINT: the block steps and their constants

// Loads the item's query rows (row m = token m / group, head kv_head * group + m % group),
// scaled, into Qt and resets the softmax state.
// `depths`: each new token's depth in its request's tree (nullptr: a chain, depth = index).
void load_tile(Tile& t, const Shape& s, const float* q, int64_t q_start, int64_t prefix,
               const int64_t* depths, const Item& it) {
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
    const int64_t token = it.first + std::min(m, t.rows - 1) / G;
    t.qpos[m] = prefix + (depths == nullptr ? token : depths[token]);
  }
  std::fill(t.acc.begin(), t.acc.begin() + t.padded * D, 0.f);
  std::fill(t.max.begin(), t.max.end(), kNegInf);
  std::fill(t.sum.begin(), t.sum.end(), 0.f);
}

// Where a request's K/V rows are: pool rows through its page-table row, for one KV head.
template <typename T>
struct Keys {
  const T *k, *v;
  const int64_t* page_row;
  int64_t kv_head;
};

// Loads the K/V rows of logical positions b .. b + n - 1; `physical` maps one to its position.
template <typename T, typename Map>
void load_block(Tile& t, const Shape& s, const Keys<T>& kv, int64_t b, int64_t n, Map physical) {
  const int64_t D = s.head_dim, span = s.num_kv_heads * D;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = physical(b + j);
    const int64_t slot = kv.page_row[pos / s.page_size] * s.page_size + pos % s.page_size;
    const int64_t off = slot * span + kv.kv_head * D;
    t.krows[j] = row_f32(kv.k + off, t.kbuf.data() + j * D, D);
    t.vrows[j] = row_f32(kv.v + off, t.vbuf.data() + j * D, D);
  }
}

// The tile over key blocks [lo, end) at their own positions (first_pos / last_pos: the
// rows' lowest / highest position).
template <typename T>
void attend_blocks(Tile& t, const Shape& s, const Keys<T>& kv, int64_t lo, int64_t end,
                   int64_t first_pos, int64_t last_pos) {
  const int64_t D = s.head_dim;
  for (int64_t b = lo; b < end; b += kKeys) {
    const int64_t n = std::min(kKeys, end - b);
    load_block(t, s, kv, b, n, [](int64_t pos) { return pos; });
    score_block(t, n, D);
    if (s.cap > 0.f) cap_block(t, n, s.cap);
    const bool crosses = b + n - 1 > first_pos || (s.window > 0 && b <= last_pos - s.window);
    if (crosses) mask_block(t, b, n, s.window);
    softmax_block(t, n, D);
    value_block(t, n, D);
  }
}

// Moves rows [lo, lo + n) of `big` (queries, positions, softmax state) to a tile of their own
// (padding as load_tile: zero queries at the last row's position), and back: a row's
// arithmetic is its own, so it runs the same in either tile.
void take_rows(const Tile& big, Tile& sub, int64_t lo, int64_t n, int64_t dim) {
  sub.rows = n;
  sub.padded = (n + kLanes - 1) / kLanes * kLanes;
  std::fill(sub.qt.begin(), sub.qt.begin() + dim * sub.padded, 0.f);
  for (int64_t d = 0; d < dim; ++d) {
    std::copy_n(big.qt.data() + d * big.padded + lo, n, sub.qt.data() + d * sub.padded);
  }
  for (int64_t m = 0; m < sub.padded; ++m) sub.qpos[m] = big.qpos[lo + std::min(m, n - 1)];
  std::fill(sub.acc.begin(), sub.acc.begin() + sub.padded * dim, 0.f);
  std::copy_n(big.acc.data() + lo * dim, n * dim, sub.acc.data());
  std::fill(sub.max.begin(), sub.max.end(), kNegInf);
  std::fill(sub.sum.begin(), sub.sum.end(), 0.f);
  std::copy_n(big.max.data() + lo, n, sub.max.data());
  std::copy_n(big.sum.data() + lo, n, sub.sum.data());
}

void give_rows(const Tile& sub, Tile& big, int64_t lo, int64_t dim) {
  std::copy_n(sub.acc.data(), sub.rows * dim, big.acc.data() + lo * dim);
  std::copy_n(sub.max.data(), sub.rows, big.max.data() + lo);
  std::copy_n(sub.sum.data(), sub.rows, big.sum.data() + lo);
}

// A draft tree's item: each of its tokens' blocks from `tail` (the prefix's last whole block)
// on, over its own keys (the rest of the prefix, then its path), in a tile of its own rows.
template <typename T>
void attend_tree_tail(Tile& t, Tile& sub, const Shape& s, const Keys<T>& kv, const Item& it,
                      int64_t prefix, const int64_t* parents, const int64_t* depths,
                      int64_t tail) {
  const int64_t D = s.head_dim, G = s.group;
  for (int64_t u = 0; u < it.num_tokens; ++u) {
    const int64_t token = it.first + u, depth = depths[token];
    sub.path.resize(depth + 1);  // the token's ancestors and itself, root first
    for (int64_t a = depth, node = token; a >= 0; --a, node = parents[node]) sub.path[a] = node;
    const int64_t last = prefix + depth;
    const int64_t lo = s.window > 0 ? std::max(tail, (last - s.window + 1) / kKeys * kKeys) : tail;
    const auto physical = [&](int64_t pos) {
      return pos < prefix ? pos : prefix + sub.path[pos - prefix];
    };
    take_rows(t, sub, u * G, G, D);
    for (int64_t b = lo; b <= last; b += kKeys) {
      const int64_t n = std::min(kKeys, last + 1 - b);
      load_block(sub, s, kv, b, n, physical);
      score_block(sub, n, D);
      if (s.cap > 0.f) cap_block(sub, n, s.cap);
      mask_block(sub, b, n, s.window);
      softmax_block(sub, n, D);
      value_block(sub, n, D);
    }
    give_rows(sub, t, u * G, D);
  }
}

// Blocks start at multiples of kKeys, whatever the tile: a row's blocks (and so its sums'
// order) are then the same alone or beside any rows; blocks a row does not see leave it as it
// was (weight 0, rescale 1).
template <typename T>
void attend_item(Tile& t, Tile* sub, const Shape& s, const Keys<T>& kv, const Item& it,
                 int64_t prefix, const int64_t* parents, const int64_t* depths) {
  if (depths == nullptr) {  // a chain: rows in position order
    const int64_t first_pos = t.qpos[0], last_pos = t.qpos[t.padded - 1];
    const int64_t lo =
        s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) / kKeys * kKeys : 0;
    attend_blocks(t, s, kv, lo, last_pos + 1, first_pos, last_pos);
    return;
  }
  const auto [lowest, highest] = std::minmax_element(t.qpos.begin(), t.qpos.begin() + t.padded);
  const int64_t tail = prefix / kKeys * kKeys;
  const int64_t lo =
      s.window > 0 ? std::max<int64_t>(0, *lowest - s.window + 1) / kKeys * kKeys : 0;
  attend_blocks(t, s, kv, lo, tail, *lowest, *highest);
  attend_tree_tail(t, *sub, s, kv, it, prefix, parents, depths, tail);
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
  const int64_t* tree_parents = nullptr;   // by q row: a new token's parent (-1: the first)
  std::vector<std::vector<int64_t>> depths;  // per request: its tokens' depths; empty: a chain
};

template <typename T>
void run(const Shape& s, const Requests& reqs, const std::vector<Item>& items, const float* q,
         const T* k, const T* v, const int64_t* page_table, float* out) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Tile t(s);
    std::unique_ptr<Tile> sub;  // a tree token's rows (attend_tree_tail), made when needed
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t r = it.req, prefix = reqs.prefix_lens[r];
      const bool tree = !reqs.depths.empty() && !reqs.depths[r].empty();
      const int64_t* depths = tree ? reqs.depths[r].data() : nullptr;
      const int64_t* parents = tree ? reqs.tree_parents + reqs.q_starts[r] : nullptr;
      load_tile(t, s, q, reqs.q_starts[r], prefix, depths, it);
      const Keys<T> kv{k, v, page_table + reqs.page_rows[r] * s.max_pages, it.kv_head};
      if (tree && !sub) sub = std::make_unique<Tile>(s);
      attend_item(t, sub.get(), s, kv, it, prefix, parents, depths);
      store_tile(t, s, it, reqs.out_starts[r], out);
    }
  });
}

// Each request's depths when its new tokens are a tree, not a chain (checks the parents).
void tree_depths(Requests& reqs, const at::Tensor& q, const at::Tensor& parents,
                 int64_t num_reqs) {
  TORCH_CHECK(parents.dim() == 1 && parents.scalar_type() == at::kLong &&
                  parents.is_contiguous() && parents.size(0) == q.size(0),
              "tree_parents must be a contiguous int64 [num_tokens] tensor, one entry per q row");
  reqs.tree_parents = parents.data_ptr<int64_t>();
  reqs.depths.resize(num_reqs);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t* p = reqs.tree_parents + reqs.q_starts[r];
    const int64_t ext = reqs.extend_lens[r];
    bool chain = true;
    for (int64_t i = 0; i < ext; ++i) {
      TORCH_CHECK(i == 0 ? p[i] == -1 : p[i] >= 0 && p[i] < i, "request ", r, ": tree_parents[",
                  reqs.q_starts[r] + i, "] = ", p[i], " is not -1 (first token) or an earlier token");
      chain = chain && p[i] == i - 1;
    }
    if (chain) continue;
    std::vector<int64_t>& depth = reqs.depths[r];
    depth.assign(ext, 0);
    for (int64_t i = 1; i < ext; ++i) depth[i] = depth[p[i]] + 1;
  }
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
                        double scale, const std::optional<at::Tensor>& tree_parents,
                        double logit_cap) {
  check_tensors(q, k_pool, v_pool, page_table, {q_starts, prefix_lens, extend_lens, page_rows});
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1");
  const int64_t num_reqs = q_starts.size(0), group = q.size(1) / k_pool.size(1);
  Requests reqs{q_starts.data_ptr<int64_t>(), prefix_lens.data_ptr<int64_t>(),
                extend_lens.data_ptr<int64_t>(), page_rows.data_ptr<int64_t>(), {}};
  check_requests(q, page_table, reqs, num_reqs, page_size, k_pool.size(0) / page_size);
  if (tree_parents.has_value()) tree_depths(reqs, q, *tree_parents, num_reqs);
  Shape s{q.size(1), k_pool.size(1), q.size(2), group, page_size, page_table.size(1),
          sliding_window, static_cast<float>(scale), static_cast<float>(logit_cap)};
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
        "int page_size, int sliding_window, float scale, Tensor? tree_parents=None, "
        "float logit_cap=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("paged_extend", &paged_extend); }
