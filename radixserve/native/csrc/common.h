// Helpers shared by the CPU kernels (attention, layer ops, the matmuls; simd.h holds the
// matmuls' vectors): plain loops that -O3 and `omp simd` vectorize for whatever SIMD width
// the build flags allow.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace radixserve_cpu {

// Asks for the cache lines of [p, p + bytes) ahead of their use: one core's hardware
// prefetchers alone keep too few lines in flight to stream weights at the memory's speed.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A K/V row as fp32: fp32 rows are used in place, bf16 rows widened into `scratch`.
inline const float* row_f32(const float* src, float*, int64_t) { return src; }
inline const float* row_f32(const c10::BFloat16* src, float* scratch, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    scratch[d] = f;
  }
  return scratch;
}

// x as contiguous fp32 [M, K] (the matmuls' activations): an fp32 input as it is, bf16
// widened into `scratch`.
inline const float* activations_f32(const at::Tensor& x, std::vector<float>& scratch) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  scratch.resize(x.numel());
  return row_f32(x.data_ptr<c10::BFloat16>(), scratch.data(), x.numel());
}

inline void axpy(float* y, float a, const float* x, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] += a * x[d];
}

inline void scale_row(float* y, float a, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] *= a;
}

// exp(x) for any float x, in a form loops vectorize (std::exp does not): x = n ln2 + r,
// |r| <= ln2/2, exp(r) by Cephes' expf polynomial (~2e-7 relative error), 2^n by building
// the float's exponent bits. x is clamped to [-87, 88], whose exp is a normal float.
inline float exp_f32(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp(x) for x <= 0 (softmax weights); inputs at or below -87 (and -inf) give 0.
inline float exp_nonpositive(float x) { return x <= -87.f ? 0.f : exp_f32(x); }

// The queries, K/V pools and page table every kernel reads: one layout, checked alike.
inline void check_q_pools_and_table(const at::Tensor& q, const at::Tensor& k_pool,
                                    const at::Tensor& v_pool, const at::Tensor& page_table,
                                    const char* op) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [num_tokens, num_heads, head_dim] tensor");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type(),
              "k_pool and v_pool must be contiguous [num_slots, num_kv_heads, head_dim] alike");
  TORCH_CHECK(k_pool.size(2) == q.size(2), "q and the pool differ in head_dim");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong &&
                  page_table.is_contiguous(),
              "page_table must be a contiguous int64 [num_rows, max_pages] tensor");
}

// The buffer a `*_dequantize_into` op writes weight rows row0 .. row0 + out.size(0) of an
// [N, K] weight into (prefill's dense matmul, panel by panel): contiguous fp32 or bf16
// [rows, K] CPU, within the weight's rows.
inline void check_panel(const at::Tensor& out, int64_t row0, int64_t N, int64_t K,
                        const char* op) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous() &&
                  out.size(1) == K &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              op, ": out must be a contiguous float32 or bfloat16 [rows, ", K, "] CPU tensor");
  TORCH_CHECK(row0 >= 0 && row0 + out.size(0) <= N, op, ": rows ", row0, " + ", out.size(0),
              " exceed the weight's ", N);
}

// fn(p) with p the data of check_panel's `out`: float* or c10::BFloat16* (the kernels' vstore
// rounds fp32 vectors to bf16 as torch's .to(torch.bfloat16) does).
template <typename Fn>
void with_panel_data(const at::Tensor& out, Fn&& fn) {
  if (out.scalar_type() == at::kFloat) fn(out.data_ptr<float>());
  else fn(out.data_ptr<c10::BFloat16>());
}

}  // namespace radixserve_cpu
