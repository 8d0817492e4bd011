// Segmented multi-LoRA (fp32): every adapter's delta on its own rows of a batch, in one call,
// where the torch path (model/lora.py `LoraProjection.add_to`) pays a gather, two matmuls per
// adapter and a scatter-add of Python-dispatched ops per projection.
//   lora_segments_add(out, x, rows, offsets, slots, ranks, at, bt)   (out updated in place)
//     x        [n, K] fp32, out [n, N] fp32: the projection's input and output
//     rows     [m] int64: the adapter rows of the batch grouped by segment; segment s is
//              rows[offsets[s] .. offsets[s+1]], served by pool slot slots[s]
//     ranks    [P] int64: each pool slot's rank padded to a multiple of 16 (0, or a slot
//              of P or more: the slot has no weights in this projection)
//     at [P, K, Rp] = A^T and bt [P, Rp, N] = B^T (scale in B) of each slot, zero-padded
//     out[row] += (x[row] @ A^T) @ B^T           for every row of every segment
// Both products are one micro-kernel, C[r, j] = sum_k X[r, k] W[k, j] with W row-major:
// vectors run along j (the output features), x[r, k] broadcast, so every output element is
// one fixed-order FMA chain over k from zero (simd.h rounds alike on every level; the
// tail columns run the same chain with std::fma). A row's result depends neither on the
// other rows of the batch nor on the tile or thread it lands in, nor on the SIMD level;
// zero-padded ranks add exact zeros. Threads split (row tile, column chunk) tasks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace radixserve_cpu::simd;

constexpr int64_t kTileRows = 4;  // rows per micro-kernel call
constexpr int64_t kChunkVecs = 4;  // vectors of output columns per micro-kernel call
constexpr int64_t kRankAlign = 16;  // padded ranks are multiples of the widest lanes

// C[r] (+)= X[r] @ W over columns [c0, c0 + V * kLanes), k in [0, K): R rows, V vectors.
template <int64_t R, int64_t V, bool Add>
void micro_kernel(const float* const* xr, const float* w, int64_t ldw, int64_t K, int64_t c0,
                  float* const* cr) {
  Vec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[V];
    for (int64_t v = 0; v < V; ++v) wv[v] = vload(w + k * ldw + c0 + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const Vec xb = vset1(xr[r][k]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = vfma(xb, wv[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) {
      float* dst = cr[r] + c0 + v * kLanes;
      vstore(dst, Add ? vadd(vload(dst), acc[r][v]) : acc[r][v]);
    }
}

// Columns [c0, c1) (fewer than kLanes) one scalar chain each: the same FMAs as a lane.
template <bool Add>
void tail_columns(const float* const* xr, int64_t rows, const float* w, int64_t ldw, int64_t K,
                  int64_t c0, int64_t c1, float* const* cr) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = c0; j < c1; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(xr[r][k], w[k * ldw + j], acc);
      cr[r][j] = Add ? cr[r][j] + acc : acc;
    }
}

template <int64_t R, bool Add>
void chunk_rows(const float* const* xr, const float* w, int64_t ldw, int64_t K, int64_t c0,
                int64_t vecs, float* const* cr) {
  switch (vecs) {
    case 4: micro_kernel<R, 4, Add>(xr, w, ldw, K, c0, cr); break;
    case 3: micro_kernel<R, 3, Add>(xr, w, ldw, K, c0, cr); break;
    case 2: micro_kernel<R, 2, Add>(xr, w, ldw, K, c0, cr); break;
    case 1: micro_kernel<R, 1, Add>(xr, w, ldw, K, c0, cr); break;
    default: break;
  }
}

// One task: up to kTileRows rows times columns [c0, min(c0 + chunk, N)) of C = X @ W.
template <bool Add>
void run_chunk(const float* const* xr, int64_t rows, const float* w, int64_t ldw, int64_t K,
               int64_t N, int64_t c0, float* const* cr) {
  const int64_t c1 = std::min(N, c0 + kChunkVecs * kLanes);
  const int64_t vecs = (c1 - c0) / kLanes;
  switch (rows) {
    case 4: chunk_rows<4, Add>(xr, w, ldw, K, c0, vecs, cr); break;
    case 3: chunk_rows<3, Add>(xr, w, ldw, K, c0, vecs, cr); break;
    case 2: chunk_rows<2, Add>(xr, w, ldw, K, c0, vecs, cr); break;
    case 1: chunk_rows<1, Add>(xr, w, ldw, K, c0, vecs, cr); break;
    default: break;
  }
  tail_columns<Add>(xr, rows, w, ldw, K, c0 + vecs * kLanes, c1, cr);
}

struct Tile {
  int64_t first;  // index into rows of the tile's first row
  int64_t count;  // rows in the tile (1 .. kTileRows)
  int64_t slot;   // pool slot
};

// Row tiles of every segment whose slot has a rank (others add nothing).
std::vector<Tile> make_tiles(const int64_t* off, const int64_t* slots, int64_t segments,
                             const int64_t* ranks, int64_t pool, int64_t m) {
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < segments; ++s) {
    TORCH_CHECK(off[s] <= off[s + 1] && off[s + 1] <= m, "lora_segments_add: offsets must "
                "not decrease and stay within rows");
    TORCH_CHECK(slots[s] >= 0, "lora_segments_add: slot out of range");
    if (slots[s] >= pool || ranks[slots[s]] == 0) continue;  // no weights in this projection
    for (int64_t i = off[s]; i < off[s + 1]; i += kTileRows)
      tiles.push_back({i, std::min(kTileRows, off[s + 1] - i), slots[s]});
  }
  return tiles;
}

// Runs `body(tile, c0)` for every tile and every column chunk of width `cols(tile)`.
template <typename Cols, typename Body>
void for_tasks(const std::vector<Tile>& tiles, Cols cols, Body body) {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (tile, c0)
  const int64_t chunk = kChunkVecs * kLanes;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t)
    for (int64_t c0 = 0; c0 < cols(tiles[t]); c0 += chunk) tasks.emplace_back(t, c0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(tiles[tasks[i].first], tasks[i].second);
  });
}

void check_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& rows,
                const at::Tensor& offsets, const at::Tensor& slots, const at::Tensor& ranks,
                const at::Tensor& at, const at::Tensor& bt) {
  for (const at::Tensor* t : {&out, &x, &rows, &offsets, &slots, &ranks, &at, &bt})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "lora_segments_add takes contiguous CPU tensors");
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  at.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat,
              "lora_segments_add takes float32 activations and weights");
  for (const at::Tensor* t : {&rows, &offsets, &slots, &ranks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1,
                "lora_segments_add: rows, offsets, slots and ranks are 1-D int64");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0),
              "lora_segments_add: x [n, K] and out [n, N]");
  TORCH_CHECK(at.dim() == 3 && bt.dim() == 3 && at.size(0) == bt.size(0) &&
                  at.size(1) == x.size(1) && bt.size(1) == at.size(2) &&
                  bt.size(2) == out.size(1) && at.size(2) % kRankAlign == 0,
              "lora_segments_add: at [P, K, Rp] and bt [P, Rp, N], Rp a multiple of 16");
  TORCH_CHECK(ranks.size(0) == at.size(0) && offsets.size(0) == slots.size(0) + 1,
              "lora_segments_add: ranks [P], offsets [S + 1], slots [S]");
}

void lora_segments_add(at::Tensor out, const at::Tensor& x, const at::Tensor& rows,
                       const at::Tensor& offsets, const at::Tensor& slots,
                       const at::Tensor& ranks, const at::Tensor& at, const at::Tensor& bt) {
  check_args(out, x, rows, offsets, slots, ranks, at, bt);
  const int64_t n = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t pool = at.size(0), Rp = at.size(2), m = rows.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  std::vector<char> seen(static_cast<size_t>(n), 0);  // tasks write their rows unlocked
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < n, "lora_segments_add: row index out of range");
    TORCH_CHECK(!seen[row[i]], "lora_segments_add: a row appears twice in rows");
    seen[row[i]] = 1;
  }
  for (int64_t p = 0; p < pool; ++p)
    TORCH_CHECK(rank[p] >= 0 && rank[p] <= Rp && rank[p] % kRankAlign == 0,
                "lora_segments_add: ranks must be multiples of 16 within Rp");
  TORCH_CHECK(offsets.data_ptr<int64_t>()[0] == 0, "lora_segments_add: offsets start at 0");
  const std::vector<Tile> tiles = make_tiles(offsets.data_ptr<int64_t>(),
                                             slots.data_ptr<int64_t>(), slots.size(0), rank,
                                             pool, m);
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* ats = at.data_ptr<float>();
  const float* bts = bt.data_ptr<float>();
  std::vector<float> shrunk(static_cast<size_t>(m * Rp));  // x[row] @ A^T, by rows index
  auto slot_rank = [&](const Tile& t) { return rank[t.slot]; };
  for_tasks(tiles, slot_rank, [&](const Tile& t, int64_t c0) {
    const float* xr[kTileRows];
    float* tr[kTileRows];
    for (int64_t r = 0; r < t.count; ++r) {
      xr[r] = xs + row[t.first + r] * K;
      tr[r] = shrunk.data() + (t.first + r) * Rp;
    }
    run_chunk<false>(xr, t.count, ats + t.slot * K * Rp, Rp, K, rank[t.slot], c0, tr);
  });
  for_tasks(tiles, [&](const Tile&) { return N; }, [&](const Tile& t, int64_t c0) {
    const float* tr[kTileRows];
    float* orow[kTileRows];
    for (int64_t r = 0; r < t.count; ++r) {
      tr[r] = shrunk.data() + (t.first + r) * Rp;
      orow[r] = os + row[t.first + r] * N;
    }
    run_chunk<true>(tr, t.count, bts + t.slot * Rp * N, N, rank[t.slot], N, c0, orow);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "lora_segments_add(Tensor(a!) out, Tensor x, Tensor rows, Tensor offsets, Tensor slots, "
      "Tensor ranks, Tensor at, Tensor bt) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("lora_segments_add", &lora_segments_add); }
