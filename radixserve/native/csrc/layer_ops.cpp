// Fused small ops of a Llama decoder layer for CPU, so that an eager decode step pays one op
// call where the torch reference pays five to ten (docs/performance.md, "Where a CPU decode
// step goes"). Each op works row by row (a token at a time; no value depends on other rows:
// batch-invariant) and rounds where its torch reference (model/layers.py) rounds, computing
// in fp32 between: float32 and bfloat16 tensors.
//   rms_norm(x, w)                    -> w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x!, residual!, w)    residual += x; x = rms_norm(residual, w)   (in place)
//   silu_mul(gate_up)                 -> silu(gate) * up, gate_up = [gate | up] per row
//   rope_store(qkv!, cos, sin, k_pool!, v_pool!, slots, ...)
//       per token: optional per-head RMSNorm of q and k (Qwen3's q_norm / k_norm), neox RoPE
//       of q and k in place in the qkv projection's output, then k and v into their pool slot
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x) {
  return static_cast<T>(x);  // bf16: round to nearest even, as torch's .to() does
}
// `x` rounded to T and read back: where the reference holds a T tensor between two ops.
template <typename T>
inline float round_to(float x) {
  return to_f32(from_f32<T>(x));
}

constexpr int64_t kRowsPerTask = 16;  // rows below this run on the calling thread

// 1 / sqrt(mean(x^2) + eps) of one row, as the reference's rsqrt(pow(2).mean() + eps).
template <typename T>
float inv_rms(const T* x, int64_t dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) {
    const float v = to_f32(x[d]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

// dst = w * T(x * inv): the reference normalizes in fp32, casts, then scales in T.
template <typename T>
void scale_row(T* dst, const T* x, const T* w, float inv, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    dst[d] = from_f32<T>(to_f32(w[d]) * round_to<T>(to_f32(x[d]) * inv));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name,
              ": x must be [rows, dim] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " takes float32 or bfloat16, not ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be a contiguous [dim] tensor of x's dtype");
}

template <typename T>
void rms_norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* w,
                   int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
      scale_row(out + r * out_stride, row, w, inv_rms(row, dim, eps), dim);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), x.size(1), x.data_ptr<scalar_t>(), x.stride(0),
                  weight.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void add_rms_norm_rows(T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* w,
                       int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * res_stride;
      T* row = x + r * x_stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) res[d] = from_f32<T>(to_f32(row[d]) + to_f32(res[d]));
      scale_row(row, res, w, inv_rms(res, dim, eps), dim);
    }
  });
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be like x");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(),
                      residual.stride(0), weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                      static_cast<float>(eps));
  });
}

using radixserve_cpu::exp_f32;

template <typename T>
void silu_mul_rows(T* out, const T* gate_up, int64_t stride, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * stride;
      const T* up = gate + half;
      T* dst = out + r * half;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float g = to_f32(gate[d]);
        const float silu = round_to<T>(g / (1.f + exp_f32(-g)));
        dst[d] = from_f32<T>(silu * to_f32(up[d]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul runs on CPU tensors");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [rows, 2 * intermediate] with contiguous rows");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "silu_mul takes float32 or bfloat16, not ", gate_up.scalar_type());
  const int64_t half = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), half}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), gate_up.stride(0),
                  gate_up.size(0), half);
  });
  return out;
}

struct RopeShape {
  int64_t num_heads, num_kv_heads, head_dim;
  float eps;
};

// One head in place: optional RMSNorm (rounded to T, as q_norm's output), then neox RoPE:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], rounded to T.
template <typename T>
void rope_head(T* head, const float* cos, const float* sin, const T* norm_w, float eps,
               int64_t dim, float* buf) {
  const int64_t half = dim / 2;
  if (norm_w != nullptr) {
    const float inv = inv_rms(head, dim, eps);
    for (int64_t d = 0; d < dim; ++d) {
      buf[d] = round_to<T>(to_f32(norm_w[d]) * round_to<T>(to_f32(head[d]) * inv));
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) buf[d] = to_f32(head[d]);
  }
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    head[d] = from_f32<T>(buf[d] * cos[d] + (-buf[d + half]) * sin[d]);
    head[d + half] = from_f32<T>(buf[d + half] * cos[d + half] + buf[d] * sin[d + half]);
  }
}

template <typename T, typename P>
void store_row(P* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<P>(to_f32(src[i]));
}

template <typename T, typename P>
void rope_store_rows(at::Tensor& qkv, const float* cos, const float* sin, P* k_pool,
                     P* v_pool, const int64_t* slots, const T* q_norm, const T* k_norm,
                     const RopeShape& s) {
  const int64_t D = s.head_dim, kv_width = s.num_kv_heads * D, stride = qkv.stride(0);
  T* base = qkv.data_ptr<T>();
  at::parallel_for(0, qkv.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t t = begin; t < end; ++t) {
      T* q = base + t * stride;
      T* k = q + s.num_heads * D;
      const float* c = cos + t * D;
      const float* sn = sin + t * D;
      for (int64_t h = 0; h < s.num_heads; ++h) {
        rope_head(q + h * D, c, sn, q_norm, s.eps, D, buf.data());
      }
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        rope_head(k + h * D, c, sn, k_norm, s.eps, D, buf.data());
      }
      store_row(k_pool + slots[t] * kv_width, k, kv_width);
      store_row(v_pool + slots[t] * kv_width, k + kv_width, kv_width);
    }
  });
}

const void* norm_weight(const std::optional<at::Tensor>& w, const at::Tensor& qkv, int64_t dim) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->dim() == 1 && w->is_contiguous() && w->size(0) == dim &&
                  w->scalar_type() == qkv.scalar_type(),
              "rope_store: q_norm / k_norm must be contiguous [head_dim] tensors of qkv's dtype");
  return w->data_ptr();
}

void check_rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& slots, const RopeShape& s) {
  const int64_t tokens = qkv.size(0), D = s.head_dim;
  TORCH_CHECK(qkv.device().is_cpu() && k_pool.device().is_cpu(), "rope_store runs on CPU");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (s.num_heads + 2 * s.num_kv_heads) * D,
              "rope_store: qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim] "
              "with contiguous rows");
  TORCH_CHECK(D % 2 == 0, "rope_store: head_dim must be even");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "rope_store: qkv must be float32 or bfloat16");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == tokens * D,
                "rope_store: cos and sin must be contiguous float32 [tokens, head_dim]");
  }
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type() &&
                  k_pool.size(1) == s.num_kv_heads && k_pool.size(2) == D,
              "rope_store: k_pool and v_pool must be contiguous [slots, num_kv_heads, "
              "head_dim] alike");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16,
              "rope_store: the pool must be float32 or bfloat16");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == tokens,
              "rope_store: slots must be a contiguous int64 [tokens] tensor");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_pool.size(0), "rope_store: slots[", t, "] = ", sp[t],
                " is not a slot of the pool");
  }
}

void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                double eps) {
  const RopeShape s{num_heads, num_kv_heads, head_dim, static_cast<float>(eps)};
  check_rope_store(qkv, cos, sin, k_pool, v_pool, slots, s);
  const void* qn = norm_weight(q_norm, qkv, head_dim);
  const void* kn = norm_weight(k_norm, qkv, head_dim);
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    using T = scalar_t;
    const T* qw = static_cast<const T*>(qn);
    const T* kw = static_cast<const T*>(kn);
    if (k_pool.scalar_type() == at::kFloat) {
      rope_store_rows<T, float>(qkv, c, sn, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                sp, qw, kw, s);
    } else {
      rope_store_rows<T, c10::BFloat16>(qkv, c, sn, k_pool.data_ptr<c10::BFloat16>(),
                                        v_pool.data_ptr<c10::BFloat16>(), sp, qw, kw, s);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_pool, "
        "Tensor(c!) v_pool, Tensor slots, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor? q_norm, Tensor? k_norm, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_store", &rope_store);
}
