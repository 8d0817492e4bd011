// The sampler's seeded U(0, 1) noise (radixserve/sampling/noise.py): a counter hash of
// (row key, vocab index) -> the top 24 bits -> (bits + 0.5) * 2^-24, clamped below 1.
// Bit for bit what noise.py computes with torch's int64 ops (which wrap as uint64 does),
// without the torch temporaries: ~20x fewer passes over a [rows, vocab] tensor.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr uint64_t kMulA = 0xFF51AFD7ED558CCDull;
constexpr uint64_t kMulB = 0xC4CEB9FE1A85EC53ull;
constexpr uint64_t kVocabStride = 0xD1B54A32D192ED03ull;
constexpr float kScale = 1.0f / 16777216.0f;     // 2^-24
constexpr float kMax = 1.0f - 1.0f / 16777216.0f;  // the largest float below 1 at 2^-24

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= kMulA;
  x ^= x >> 33;
  x *= kMulB;
  return x ^ (x >> 33);
}

// row_keys [R] int64 (noise.py's per-row key), ids [R, K] or [1, K] int64 -> [R, K] float32.
at::Tensor uniform_noise_at(const at::Tensor& row_keys, const at::Tensor& ids) {
  TORCH_CHECK(row_keys.dim() == 1 && ids.dim() == 2, "row_keys [R] and ids [R or 1, K]");
  TORCH_CHECK(row_keys.scalar_type() == at::kLong && ids.scalar_type() == at::kLong,
              "row_keys and ids must be int64");
  const int64_t rows = row_keys.size(0), cols = ids.size(1);
  TORCH_CHECK(ids.size(0) == rows || ids.size(0) == 1, "ids must have R rows or one");
  const at::Tensor keys = row_keys.contiguous(), index = ids.contiguous();
  at::Tensor out = at::empty({rows, cols}, row_keys.options().dtype(at::kFloat));
  const uint64_t* kp = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const uint64_t* ip = reinterpret_cast<const uint64_t*>(index.data_ptr<int64_t>());
  float* op = out.data_ptr<float>();
  const int64_t id_stride = ids.size(0) == 1 ? 0 : cols;
  at::parallel_for(0, rows * cols, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / cols, c = i % cols;
      const uint64_t bits = mix64(kp[r] + ip[r * id_stride + c] * kVocabStride) >> 40;
      op[i] = std::min((static_cast<float>(bits) + 0.5f) * kScale, kMax);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("uniform_noise_at(Tensor row_keys, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("uniform_noise_at", &uniform_noise_at); }
