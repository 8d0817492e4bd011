// Small-M matmul over GGUF-style weight blocks (decode: 1 to ~100 rows), out = x @ W.T.
//
// A weight row is K / 32 blocks of 32 inputs, stored per output row in block order:
//   int4 (Q4_0 / Q4_1): qs [N, K / 2] uint8, byte j of a block = element j (low nibble) |
//                       element j + 16 (high nibble); scale_min [N, K / 32, 2] fp32 (d, m),
//                       w = q * d + m
//   int8 (Q8_0):        qs [N, K] int8; scales [N, K / 32] fp32, w = q * d
// Each block's 32 weights are dequantized to fp32 once and multiplied into up to kTileRows
// activation rows (fp32 FMAs, no rounding of the activations): exact to fp32 summation
// order. A row's arithmetic is the same whatever the number of rows (row-invariant), so
// --enable-deterministic-inference can use it for every batch. AVX512 / AVX2 intrinsics by
// the build flags (plain loops otherwise: correct, slow); weight rows prefetched ahead;
// activations past L1 taken tile by tile over chunks of weight rows; at::parallel_for over
// output rows. docs/performance.md ("GGUF blocks on the C++ block kernels") has the numbers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "block_dequant.h"
#include "common.h"

#include <algorithm>
#include <string>
#include <vector>

namespace {

using namespace radixserve_blocks;
using radixserve_cpu::activations_f32;
using radixserve_cpu::check_panel;

// Activation rows sharing one dequantized block, at most: R x kChains x kVecs accumulators
// stay in registers (AVX-512: 20 of 32 zmm at 5 rows, 9 rows take 2 passes instead of 3;
// 6 rows measured slower at 9 rows on Zen 4; AVX2: 16 of 16 ymm at 4).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 5;
#else
constexpr int64_t kTileRows = 4;
#endif
constexpr int64_t kGrain = 16;    // output rows per parallel_for chunk, at least
constexpr int64_t kPrefetchRows = 4;  // weight rows asked for ahead of the one in use
constexpr int64_t kChunkRows = 16;     // weight rows per chunk when activations exceed L1
constexpr int64_t kL1Bytes = 32 * 1024;  // activations up to this size stay in L1 as they are

struct Int4Rows {
  const uint8_t* qs;
  const float* scale_min;
  void prefetch_row(int64_t n, int64_t num_blocks) const {
    prefetch(qs + n * num_blocks * kHalf, num_blocks * kHalf);
    prefetch(scale_min + n * num_blocks * 2, num_blocks * 2 * sizeof(float));
  }
  void block(int64_t n, int64_t b, int64_t num_blocks, Vec* w) const {
    const float* sm = scale_min + (n * num_blocks + b) * 2;
    dequant_int4(qs + (n * num_blocks + b) * kHalf, sm[0], sm[1], w);
  }
};

struct Int8Rows {
  const int8_t* qs;
  const float* scales;
  void prefetch_row(int64_t n, int64_t num_blocks) const {
    prefetch(qs + n * num_blocks * kBlock, num_blocks * kBlock);
    prefetch(scales + n * num_blocks, num_blocks * sizeof(float));
  }
  void block(int64_t n, int64_t b, int64_t num_blocks, Vec* w) const {
    dequant_int8(qs + (n * num_blocks + b) * kBlock, scales[n * num_blocks + b], w);
  }
};

// acc[c] += w * x over one block's vectors.
inline void fma_block(Vec* acc, const Vec* w, const float* x) {
  for (int64_t i = 0; i < kVecs; ++i) acc[i] = vfma(w[i], vload(x + i * kLanes), acc[i]);
}

// out[r, n] for R activation rows starting at x (fp32, row stride K), one weight row n.
// Block b goes to accumulator set b % kChains of its row: the same sums in the same order
// for a row whatever R is.
template <int64_t R, typename Weights>
void dot_rows(const Weights& weights, int64_t n, int64_t num_blocks, const float* x, int64_t K,
              float* out, int64_t N) {
  Vec acc[R][kChains][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kChains; ++c)
      for (int64_t i = 0; i < kVecs; ++i) acc[r][c][i] = vzero();
  Vec w[kVecs];
  int64_t b = 0;
  for (; b + kChains <= num_blocks; b += kChains) {
    for (int64_t c = 0; c < kChains; ++c) {
      weights.block(n, b + c, num_blocks, w);
      for (int64_t r = 0; r < R; ++r) fma_block(acc[r][c], w, x + r * K + (b + c) * kBlock);
    }
  }
  for (; b < num_blocks; ++b) {  // a tail shorter than kChains blocks: set b % kChains
    weights.block(n, b, num_blocks, w);
    for (int64_t r = 0; r < R; ++r) fma_block(acc[r][b % kChains], w, x + r * K + b * kBlock);
  }
  for (int64_t r = 0; r < R; ++r) {
    Vec total = acc[r][0][0];
    for (int64_t c = 0; c < kChains; ++c)
      for (int64_t i = c == 0 ? 1 : 0; i < kVecs; ++i) total = vadd(total, acc[r][c][i]);
    out[r * N + n] = vsum(total);
  }
}

// Every activation row against weight row n, in tiles of up to kTileRows rows (the weight
// row stays in L1 while the tiles pass over it).
template <typename Weights>
void dot_weight_row(const Weights& weights, int64_t n, int64_t num_blocks, const float* x,
                    int64_t M, int64_t K, float* out, int64_t N) {
  int64_t r = 0;
  for (; r + kTileRows <= M; r += kTileRows)
    dot_rows<kTileRows>(weights, n, num_blocks, x + r * K, K, out + r * N, N);
  switch (M - r) {
#if defined(__AVX512F__)
    case 4: dot_rows<4>(weights, n, num_blocks, x + r * K, K, out + r * N, N); break;
#endif
    case 3: dot_rows<3>(weights, n, num_blocks, x + r * K, K, out + r * N, N); break;
    case 2: dot_rows<2>(weights, n, num_blocks, x + r * K, K, out + r * N, N); break;
    case 1: dot_rows<1>(weights, n, num_blocks, x + r * K, K, out + r * N, N); break;
    default: break;
  }
}

// Weight rows [n0, n1). With more activation rows than one tile whose rows do not all fit
// in L1 (e.g. 16 x 1536 fp32 = 96 KiB), weight rows go in chunks of kChunkRows and each tile
// of activations passes over a whole chunk before the next tile: each stays in L1.
template <typename Weights>
void dot_range(const Weights& weights, int64_t n0, int64_t n1, int64_t num_blocks,
               const float* x, int64_t M, int64_t K, float* out, int64_t N) {
  if (M <= kTileRows || M * K * static_cast<int64_t>(sizeof(float)) <= kL1Bytes) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) weights.prefetch_row(n + kPrefetchRows, num_blocks);
      dot_weight_row(weights, n, num_blocks, x, M, K, out, N);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(c0 + kChunkRows, n1);
    for (int64_t r = 0; r < M; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, M - r);
      for (int64_t n = c0; n < c1; ++n) {
        if (r == 0 && n + kPrefetchRows < n1) weights.prefetch_row(n + kPrefetchRows, num_blocks);
        dot_weight_row(weights, n, num_blocks, x + r * K, rows, K, out + r * N, N);
      }
    }
  }
}

void check_activations(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a contiguous float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, op, ": K must be a multiple of 32, got ", x.size(1));
}

template <typename Weights>
at::Tensor run(const at::Tensor& x, const Weights& weights, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), num_blocks = K / kBlock;
  std::vector<float> scratch;
  const float* xf = activations_f32(x, scratch);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    dot_range(weights, n0, n1, num_blocks, xf, M, K, o, N);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor int4_block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale_min) {
  check_activations(x, "int4_block_mm");
  const int64_t N = qs.size(0), K = x.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) * 2 == K,
              "int4_block_mm: qs must be a contiguous uint8 [N, K / 2] tensor");
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == N &&
                  scale_min.size(1) * kBlock == K && scale_min.size(2) == 2,
              "int4_block_mm: scale_min must be a contiguous float32 [N, K / 32, 2] tensor");
  const Int4Rows weights{qs.data_ptr<uint8_t>(), scale_min.data_ptr<float>()};
  return run(x, weights, N);
}

at::Tensor int8_block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales) {
  check_activations(x, "int8_block_mm");
  const int64_t N = qs.size(0), K = x.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) == K,
              "int8_block_mm: qs must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == N && scales.size(1) * kBlock == K,
              "int8_block_mm: scales must be a contiguous float32 [N, K / 32] tensor");
  const Int8Rows weights{qs.data_ptr<int8_t>(), scales.data_ptr<float>()};
  return run(x, weights, N);
}

// Weight rows row0 .. row0 + out.size(0), dequantized as the kernels read them, into `out`
// [rows, K] (fp32, or those values rounded to bf16): prefill's dense matmul takes a weight
// panel by panel through one buffer it reuses (dense_panels.py), so no call pays for fresh
// pages.
template <typename W>
void dequantize_into(const W& weights, int64_t row0, int64_t num_blocks, const at::Tensor& out) {
  radixserve_cpu::with_panel_data(out, [&](auto* o) {
    at::parallel_for(0, out.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      Vec w[kVecs];
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          weights.block(row0 + r, b, num_blocks, w);
          auto* dst = o + (r * num_blocks + b) * kBlock;
          for (int64_t i = 0; i < kVecs; ++i) vstore(dst + i * kLanes, w[i]);
        }
      }
    });
  });
}

void int4_block_dequantize_into(const at::Tensor& qs, const at::Tensor& scale_min, int64_t row0,
                                at::Tensor out) {
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 &&
                  scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == qs.size(0) &&
                  scale_min.size(1) * kHalf == qs.size(1),
              "int4_block_dequantize_into: qs must be uint8 [N, K / 2], scale_min float32 "
              "[N, K / 32, 2]");
  check_panel(out, row0, qs.size(0), qs.size(1) * 2, "int4_block_dequantize_into");
  const Int4Rows weights{qs.data_ptr<uint8_t>(), scale_min.data_ptr<float>()};
  dequantize_into(weights, row0, scale_min.size(1), out);
}

void int8_block_dequantize_into(const at::Tensor& qs, const at::Tensor& scales, int64_t row0,
                                at::Tensor out) {
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == qs.size(0) &&
                  scales.size(1) * kBlock == qs.size(1),
              "int8_block_dequantize_into: qs must be int8 [N, K], scales float32 [N, K / 32]");
  check_panel(out, row0, qs.size(0), qs.size(1), "int8_block_dequantize_into");
  const Int8Rows weights{qs.data_ptr<int8_t>(), scales.data_ptr<float>()};
  dequantize_into(weights, row0, scales.size(1), out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("int4_block_mm(Tensor x, Tensor qs, Tensor scale_min) -> Tensor");
  m.def("int8_block_mm(Tensor x, Tensor qs, Tensor scales) -> Tensor");
  m.def("int4_block_dequantize_into(Tensor qs, Tensor scale_min, int row0, Tensor(a!) out) -> ()");
  m.def("int8_block_dequantize_into(Tensor qs, Tensor scales, int row0, Tensor(a!) out) -> ()");
  // Which SIMD path the extension was built with (avx512, avx2, portable): every kernel
  // file follows the same build flags. No tensor argument: a catch-all.
  m.def("simd_level() -> str", [] { return std::string(kSimd); });
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("int4_block_mm", &int4_block_mm);
  m.impl("int8_block_mm", &int8_block_mm);
  m.impl("int4_block_dequantize_into", &int4_block_dequantize_into);
  m.impl("int8_block_dequantize_into", &int8_block_dequantize_into);
}
