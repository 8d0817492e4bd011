// Small-M matmul over GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K), out = x @ W.T, with the
// weights as the file stores them: [N, K / 256 * block_bytes] uint8, one row of super-blocks
// per output row (kquant_blocks.h has the layouts). Same scheme as block_matmul.cpp: each
// unit of 32 weights is dequantized to fp32 once (exactly the gguf package's values) and
// multiplied into up to kTileRows activation rows with fp32 FMAs; unit u of a super-block
// goes to accumulator set u % kChains, so a row's sums and their order do not depend on how
// many rows share the call (row-invariant: --enable-deterministic-inference may use it).
// AVX512 / AVX2 intrinsics by the build flags (plain loops otherwise); weight rows prefetched
// ahead; activations past L1 taken tile by tile over chunks of weight rows; at::parallel_for
// over output rows. `kquant_dequantize` writes the same fp32 weights out (prefill's dense
// matmul, tests).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"
#include "kquant_blocks.h"
#include "kquant_simd.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace radixserve_kquant;
using namespace radixserve_kquant::simd;
using radixserve_cpu::activations_f32;
using radixserve_cpu::prefetch;

// Activation rows sharing one dequantized unit, at most: R x kChains x kVecs accumulators
// stay in registers (AVX-512: 20 of 32 zmm at 5 rows, the rest for the unit's lookups, where
// 6 rows measured slower at 9 rows; AVX2: 16 of 16 ymm at 4).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 5;
#else
constexpr int64_t kTileRows = 4;
#endif
constexpr int64_t kGrain = 16;         // output rows per parallel_for chunk, at least
constexpr int64_t kPrefetchRows = 4;   // weight rows asked for ahead of the one in use
constexpr int64_t kChunkRows = 16;     // weight rows per chunk when activations exceed L1
constexpr int64_t kL1Bytes = 32 * 1024;  // activations up to this size stay in L1 as they are
// ggml's type ids (gguf.GGMLQuantizationType); the repacked ones, kQ4KX8 / kQ5KX8 / kQ6KX8,
// are in kquant_blocks.h
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;


// One format's view of its super-blocks: bytes, the per-super-block factors, a unit's weights.
struct Q4K {
  static constexpr int64_t kBytes = 144;
  static void scales(const uint8_t* b, SuperScales& s) { scales_k4(b, s); }
  static void unit(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
    unit_q4k(b, u, s, w);
  }
};
struct Q5K {
  static constexpr int64_t kBytes = 176;
  static void scales(const uint8_t* b, SuperScales& s) { scales_k4(b, s); }
  static void unit(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
    unit_q5k(b, u, s, w);
  }
};
struct Q6K {
  static constexpr int64_t kBytes = 210;
  static void scales(const uint8_t* b, SuperScales& s) { scales_q6(b, s); }
  static void unit(const uint8_t* b, int64_t u, const SuperScales& s, Vec* w) {
    unit_q6k(b, u, s, w);
  }
};

// Makes the unit loop read each factor of `s` from memory (a broadcast load) rather than
// shuffle it out of the register it was computed in: shuffles and register broadcasts take
// the port the table lookups need.
inline void from_memory(SuperScales& s) {
#if defined(__GNUC__)
  __asm__ volatile("" : : "r"(&s) : "memory");
#endif
}

inline void fma_unit(Vec* acc, const Vec* w, const float* x) {
  for (int64_t i = 0; i < kVecs; ++i) acc[i] = vfma(w[i], vload(x + i * kLanes), acc[i]);
}

// out[r, n] for R activation rows from x (fp32, row stride K) against weight row `row`.
template <int64_t R, typename F>
void dot_rows(const uint8_t* row, int64_t num_super, const float* x, int64_t K, float* out,
              int64_t N) {
  Vec acc[R][kChains][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChains; ++c)
      for (int64_t i = 0; i < kVecs; ++i) acc[r][c][i] = vzero();
  SuperScales s;
  Vec w[kVecs];
  for (int64_t b = 0; b < num_super; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    F::scales(block, s);
    from_memory(s);
    // Unrolled: the accumulator set u % kChains and the unit's shifts become constants
    // (a runtime index would keep the accumulators in memory).
#pragma GCC unroll 8
    for (int64_t u = 0; u < kUnits; ++u) {
      F::unit(block, u, s, w);
      const float* xu = x + b * kSuper + u * kUnit;
      for (int64_t r = 0; r < R; ++r) fma_unit(acc[r][u % kChains], w, xu + r * K);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    Vec total = acc[r][0][0];
    for (int64_t c = 0; c < kChains; ++c)
      for (int64_t i = c == 0 ? 1 : 0; i < kVecs; ++i) total = vadd(total, acc[r][c][i]);
    out[r * N] = vsum(total);
  }
}

// Every activation row against one weight row, in tiles of up to kTileRows rows.
template <typename F>
void dot_weight_row(const uint8_t* row, int64_t num_super, const float* x, int64_t M, int64_t K,
                    float* out, int64_t N) {
  int64_t r = 0;
  for (; r + kTileRows <= M; r += kTileRows)
    dot_rows<kTileRows, F>(row, num_super, x + r * K, K, out + r * N, N);
  switch (M - r) {
#if defined(__AVX512F__)
    case 4: dot_rows<4, F>(row, num_super, x + r * K, K, out + r * N, N); break;
#endif
    case 3: dot_rows<3, F>(row, num_super, x + r * K, K, out + r * N, N); break;
    case 2: dot_rows<2, F>(row, num_super, x + r * K, K, out + r * N, N); break;
    case 1: dot_rows<1, F>(row, num_super, x + r * K, K, out + r * N, N); break;
    default: break;
  }
}

// Weight rows [n0, n1); past L1, weight rows go in chunks of kChunkRows and each tile of
// activations passes over a whole chunk before the next tile (as block_matmul.cpp).
template <typename F>
void dot_range(const uint8_t* w, int64_t n0, int64_t n1, int64_t num_super, const float* x,
               int64_t M, int64_t K, float* out, int64_t N) {
  const int64_t row_bytes = num_super * F::kBytes;
  if (M <= kTileRows || M * K * static_cast<int64_t>(sizeof(float)) <= kL1Bytes) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) prefetch(w + (n + kPrefetchRows) * row_bytes, row_bytes);
      dot_weight_row<F>(w + n * row_bytes, num_super, x, M, K, out + n, N);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(c0 + kChunkRows, n1);
    for (int64_t r = 0; r < M; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, M - r);
      for (int64_t n = c0; n < c1; ++n) {
        if (r == 0 && n + kPrefetchRows < n1)
          prefetch(w + (n + kPrefetchRows) * row_bytes, row_bytes);
        dot_weight_row<F>(w + n * row_bytes, num_super, x + r * K, rows, K, out + r * N + n, N);
      }
    }
  }
}

template <typename F, typename T>
void dequantize_rows(const uint8_t* w, int64_t n0, int64_t n1, int64_t num_super, T* out) {
  SuperScales s;
  Vec v[kVecs];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < num_super; ++b) {
      const uint8_t* block = w + (n * num_super + b) * F::kBytes;
      F::scales(block, s);
#pragma GCC unroll 8
      for (int64_t u = 0; u < kUnits; ++u) {
        F::unit(block, u, s, v);
        T* o = out + (n * num_super + b) * kSuper + u * kUnit;
        for (int64_t i = 0; i < kVecs; ++i) vstore(o + i * kLanes, v[i]);
      }
    }
  }
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4K: return Q4K::kBytes;
    case kQ5K: return Q5K::kBytes;
    case kQ6K: return Q6K::kBytes;
    case kQ4KX8: return Q4K::kBytes;
    case kQ5KX8: return Q5K::kBytes;
    case kQ6KX8: return Q6K::kBytes;
    default:
      TORCH_CHECK(false, "kquant: ggml type ", qtype,
                  " is not Q4_K (12), Q5_K (13), Q6_K (14) or repacked (1012 / 1013 / 1014)");
  }
}

// Runs fn(format) for the format of ggml type `qtype`.
template <typename Fn>
void by_format(int64_t qtype, Fn&& fn) {
  if (qtype == kQ4K || qtype == kQ4KX8) fn(Q4K{});
  else if (qtype == kQ5K || qtype == kQ5KX8) fn(Q5K{});
  else fn(Q6K{});
}

// fn(rows, first, count) over weight rows [n0, n1) of `w` ([N, K / 256 * bytes]) in the row
// layout these kernels read: as they lie, or repacked rows unpacked group by group.
template <typename Fn>
void over_rows(int64_t qtype, const uint8_t* w, int64_t N, int64_t num_super, int64_t n0,
               int64_t n1, Fn&& fn) {
  if (qtype == kQ4KX8) return for_rows_unpacked<Q4KX8Layout>(w, N, num_super, n0, n1, fn);
  if (qtype == kQ5KX8) return for_rows_unpacked<Q5KX8Layout>(w, N, num_super, n0, n1, fn);
  if (qtype == kQ6KX8) return for_rows_unpacked<Q6KX8Layout>(w, N, num_super, n0, n1, fn);
  fn(w + n0 * num_super * block_bytes(qtype), n0, n1 - n0);
}

// The number of super-blocks per weight row, after checking `blocks` is [N, that * bytes].
int64_t super_blocks_per_row(const at::Tensor& blocks, int64_t qtype, const char* op) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % bytes == 0,
              op, ": blocks must be a contiguous uint8 [N, K / 256 * ", bytes, "] CPU tensor");
  return blocks.size(1) / bytes;
}

// Weight rows [n0, n1) of `w` (any layout) into out ([n1 - n0, K] fp32, or rounded to bf16).
void dequantize_range(int64_t qtype, const uint8_t* w, int64_t N, int64_t num_super, int64_t n0,
                      int64_t n1, const at::Tensor& out) {
  by_format(qtype, [&](auto format) {
    using F = decltype(format);
    radixserve_cpu::with_panel_data(out, [&](auto* o) {
      at::parallel_for(n0, n1, kGrain, [&](int64_t r0, int64_t r1) {
        over_rows(qtype, w, N, num_super, r0, r1, [&](const uint8_t* rows, int64_t first,
                                                      int64_t count) {
          dequantize_rows<F>(rows, 0, count, num_super, o + (first - n0) * num_super * kSuper);
        });
      });
    });
  });
}

at::Tensor kquant_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  const int64_t num_super = super_blocks_per_row(blocks, qtype, "kquant_mm");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant_mm: x must be a contiguous float32 or bfloat16 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K == num_super * kSuper, "kquant_mm: x has K = ", K, ", the blocks ",
              num_super * kSuper);
  std::vector<float> scratch;
  const float* xf = activations_f32(x, scratch);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  by_format(qtype, [&](auto format) {
    using F = decltype(format);
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
      over_rows(qtype, w, N, num_super, n0, n1, [&](const uint8_t* rows, int64_t first,
                                                    int64_t count) {
        dot_range<F>(rows, 0, count, num_super, xf, M, K, o + first, N);
      });
    });
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t qtype) {
  const int64_t num_super = super_blocks_per_row(blocks, qtype, "kquant_dequantize");
  const int64_t N = blocks.size(0);
  at::Tensor out = at::empty({N, num_super * kSuper}, blocks.options().dtype(at::kFloat));
  dequantize_range(qtype, blocks.data_ptr<uint8_t>(), N, num_super, 0, N, out);
  return out;
}

// Weight rows row0 .. row0 + out.size(0) into `out` [rows, K], the values kquant_dequantize
// gives (fp32, or those rounded to bf16): prefill's dense matmul goes panel by panel through
// one reused buffer (dense_panels.py).
void kquant_dequantize_into(const at::Tensor& blocks, int64_t qtype, int64_t row0, at::Tensor out) {
  const int64_t num_super = super_blocks_per_row(blocks, qtype, "kquant_dequantize_into");
  radixserve_cpu::check_panel(out, row0, blocks.size(0), num_super * kSuper,
                              "kquant_dequantize_into");
  dequantize_range(qtype, blocks.data_ptr<uint8_t>(), blocks.size(0), num_super, row0,
                   row0 + out.size(0), out);
}

// The same bytes repacked 8 rows at a time (Q4_K, Q5_K, Q6_K; kquant_blocks.h): a new tensor.
at::Tensor kquant_repack_x8(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4K || qtype == kQ5K || qtype == kQ6K,
              "kquant_repack_x8: only Q4_K (12), Q5_K (13) and Q6_K (14) repack; got ggml type ",
              qtype);
  const int64_t num_super = super_blocks_per_row(blocks, qtype, "kquant_repack_x8");
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1), grouped = N / kX8Rows * kX8Rows;
  at::Tensor out = at::empty(blocks.sizes(), blocks.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, grouped / kX8Rows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t at = g0 * kX8Rows * row_bytes; at < g1 * kX8Rows * row_bytes;
         at += kX8Rows * row_bytes) {
      if (qtype == kQ4K) repack_x8_group<Q4KX8Layout>(w + at, o + at, num_super);
      else if (qtype == kQ5K) repack_x8_group<Q5KX8Layout>(w + at, o + at, num_super);
      else repack_x8_group<Q6KX8Layout>(w + at, o + at, num_super);
    }
  });
  std::memcpy(o + grouped * row_bytes, w + grouped * row_bytes, (N - grouped) * row_bytes);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("kquant_mm(Tensor x, Tensor blocks, int qtype) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int qtype) -> Tensor");
  m.def("kquant_dequantize_into(Tensor blocks, int qtype, int row0, Tensor(a!) out) -> ()");
  m.def("kquant_repack_x8(Tensor blocks, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("kquant_mm", &kquant_mm);
  m.impl("kquant_dequantize", &kquant_dequantize);
  m.impl("kquant_dequantize_into", &kquant_dequantize_into);
  m.impl("kquant_repack_x8", &kquant_repack_x8);
}
