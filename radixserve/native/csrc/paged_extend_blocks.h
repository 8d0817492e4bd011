// The block steps of paged_extend.cpp's tiles (a tile: a work item's query rows, kept
// transposed; a block: kKeys key positions): scores by a register-tiled outer product, the
// causal / window mask, the online-softmax rescale, and P V.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace radixserve_extend {

using radixserve_cpu::exp_nonpositive;
using radixserve_cpu::kNegInf;

constexpr int64_t kKeys = 64;      // key positions per online-softmax rescale
constexpr int64_t kTileRows = 64;  // query rows (tokens x GQA heads) per work item, at most
constexpr int64_t kLanes = 16;     // rows per register tile of the score product
constexpr int64_t kKeyTile = 8;    // keys per register tile of the score product
#if defined(__AVX512F__)
constexpr int64_t kScoreLanes = kLanes;  // the tile's rows: kKeyTile accumulators of them
#else
constexpr int64_t kScoreLanes = 8;  // 8 ymm accumulators, not 16 (the whole register file)
#endif
constexpr int64_t kPvRows = 4;     // rows per register tile of the P V product

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, group, page_size, max_pages;
  int64_t window;  // <= 0: none
  float scale;
  float cap;  // > 0: scores soft-capped to cap * tanh(score / cap) (Gemma); else plain
};

struct Item {
  int64_t req, kv_head, first, num_tokens;  // the tile: new tokens [first, first + num_tokens)
};

// Per-thread buffers of one work item; rows padded to a multiple of kLanes (padding rows
// repeat the last real row's position, so they never produce NaN, and are not written out).
struct Tile {
  int64_t rows = 0, padded = 0;
  std::vector<float> qt, scores, acc, max, sum, ref, alpha;
  std::vector<int64_t> qpos, path;  // path: a tree token's ancestors (attend_tree_tail)
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
inline void score_block(Tile& t, int64_t n, int64_t dim) {
  const int64_t P = t.padded;
  for (int64_t m0 = 0; m0 < P; m0 += kScoreLanes) {
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
      const float* kr[kKeyTile];
      for (int64_t jj = 0; jj < kKeyTile; ++jj) kr[jj] = t.krows[std::min(j0 + jj, n - 1)];
      float acc[kKeyTile][kScoreLanes] = {};
      for (int64_t d = 0; d < dim; ++d) {
        const float* qv = t.qt.data() + d * P + m0;
        for (int64_t jj = 0; jj < kKeyTile; ++jj) {
          const float kd = kr[jj][d];
#pragma omp simd
          for (int64_t l = 0; l < kScoreLanes; ++l) acc[jj][l] += kd * qv[l];
        }
      }
      for (int64_t jj = 0; jj < std::min(kKeyTile, n - j0); ++jj) {
        std::copy(acc[jj], acc[jj] + kScoreLanes, t.scores.data() + (j0 + jj) * P + m0);
      }
    }
  }
}

// S -> cap * tanh(S / cap) for the block's n keys (attention soft-capping), before the mask.
inline void cap_block(Tile& t, int64_t n, float cap) {
  const int64_t P = t.padded;
  for (int64_t j = 0; j < n; ++j) {
    float* s = t.scores.data() + j * P;
    for (int64_t m = 0; m < P; ++m) s[m] = cap * std::tanh(s[m] / cap);
  }
}

// -inf where key position b + j is after a row's position or outside its window.
inline void mask_block(Tile& t, int64_t b, int64_t n, int64_t window) {
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
inline void softmax_block(Tile& t, int64_t n, int64_t dim) {
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
inline void value_block(Tile& t, int64_t n, int64_t dim) {
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

}  // namespace radixserve_extend
