// Mixture-of-experts experts in one call (fp32): every local expert's run of rows, where the
// torch path (model/moe.py `grouped_experts`) pays a Python loop of two matmuls per expert
// that got rows (Qwen3-30B-A3B: 128 experts, up to 128 of them at batch 16, 48 layers).
//   moe_grouped_experts(rows, offsets, w13, w2) -> out
//     rows    [n, hidden] fp32, sorted by expert: expert e's rows are offsets[e] .. offsets[e+1]
//     offsets [E + 1] int64, offsets[0] = 0, offsets[E] = n
//     w13     [E, 2 * inter, hidden]: gate rows, then up rows;  w2 [E, hidden, inter]
//     out[r] = w2[e] . (silu(gate) * up),  [gate | up] = w13[e] . rows[r]
// Tasks are (expert that got rows, tile of output features): a weight row is read once and
// dotted with each of its expert's rows while it sits in L1 (decode: a few rows an expert),
// experts in parallel. Each output is one FMA chain (simd.h) over the input in a fixed order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace radixserve_cpu::simd;

constexpr int64_t kTile = 32;  // output features per task

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc0 = vzero(), acc1 = vzero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= n; k += 2 * kLanes) {
    acc0 = vfma(vload(a + k), vload(b + k), acc0);
    acc1 = vfma(vload(a + k + kLanes), vload(b + k + kLanes), acc1);
  }
  for (; k + kLanes <= n; k += kLanes) acc0 = vfma(vload(a + k), vload(b + k), acc0);
  float sum = vsum(vadd(acc0, acc1));
  for (; k < n; ++k) sum = std::fma(a[k], b[k], sum);
  return sum;
}

// out[r, j] = x[r] . w[e, j] for each row r of expert e; only experts with rows make tasks.
void grouped_matmul(const float* x, const int64_t* offsets, const std::vector<int64_t>& experts,
                    const float* w, int64_t out_features, int64_t in_features, float* out) {
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  const int64_t tasks = static_cast<int64_t>(experts.size()) * tiles;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = experts[t / tiles], j0 = (t % tiles) * kTile;
      const int64_t j1 = std::min(out_features, j0 + kTile);
      const float* we = w + e * out_features * in_features;
      for (int64_t j = j0; j < j1; ++j) {
        const float* wj = we + j * in_features;
        for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
          out[r * out_features + j] = dot(x + r * in_features, wj, in_features);
        }
      }
    }
  });
}

at::Tensor moe_grouped_experts(const at::Tensor& rows, const at::Tensor& offsets,
                               const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(rows.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(),
              "moe_grouped_experts runs on CPU tensors");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat &&
                  w2.scalar_type() == at::kFloat,
              "moe_grouped_experts takes float32 rows and weights");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && w13.dim() == 3 &&
                  w13.is_contiguous() && w2.dim() == 3 && w2.is_contiguous(),
              "moe_grouped_experts: rows [n, hidden], w13 [E, 2 inter, hidden], w2 [E, hidden, "
              "inter], contiguous");
  const int64_t n = rows.size(0), hidden = rows.size(1), num_experts = w13.size(0);
  const int64_t inter = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == num_experts &&
                  w2.size(1) == hidden && w2.size(2) == inter,
              "moe_grouped_experts: w13 / w2 shapes do not match rows");
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong &&
                  offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.size(0) == num_experts + 1,
              "moe_grouped_experts: offsets must be int64 [E + 1] on CPU");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[num_experts] == n, "moe_grouped_experts: offsets span 0..n");
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(off[e] <= off[e + 1], "moe_grouped_experts: offsets must not decrease");
    if (off[e] < off[e + 1]) experts.push_back(e);
  }
  at::Tensor gate_up = at::empty({n, 2 * inter}, rows.options());
  at::Tensor act = at::empty({n, inter}, rows.options());
  at::Tensor out = at::empty({n, hidden}, rows.options());
  grouped_matmul(rows.data_ptr<float>(), off, experts, w13.data_ptr<float>(), 2 * inter, hidden,
                 gate_up.data_ptr<float>());
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < inter; ++d) {
        const float g = gu[r * 2 * inter + d];
        a[r * inter + d] = g / (1.0f + std::exp(-g)) * gu[r * 2 * inter + inter + d];
      }
    }
  });
  grouped_matmul(a, off, experts, w2.data_ptr<float>(), hidden, inter, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("moe_grouped_experts(Tensor rows, Tensor offsets, Tensor w13, Tensor w2) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("moe_grouped_experts", &moe_grouped_experts); }
