// Small-M matmul over GGUF-style weight blocks (decode: 1 to ~100 rows), out = x @ W.T.
//
// A weight row is K / 32 blocks of 32 inputs, stored per output row in block order:
//   int4 (Q4_0 / Q4_1): qs [N, K / 2] uint8, byte j of a block = element j (low nibble) |
//                       element j + 16 (high nibble); scale_min [N, K / 32, 2] fp32 (d, m),
//                       w = q * d + m
//   int8 (Q8_0):        qs [N, K] int8; scales [N, K / 32] fp32, w = q * d
// Each block's 32 weights are dequantized to fp32 once and multiplied into up to kTileRows
// activation rows (fp32 FMAs, no rounding of the activations): exact to fp32 summation
// order. AVX2 builds take the factored form instead, fewer FMAs a block (the block's codes
// dotted with x, then its scale, and Int4's offsets against x's block sums once a row: the
// dequantized weights' rounding never happens there, so its last bits differ from the other
// levels'). A row's arithmetic is the same whatever the number of rows (row-invariant), so
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
#include "q8_simd.h"  // load_pairs: 8 blocks' (d, m) pairs, a tail masked

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace radixserve_blocks;
using radixserve_cpu::activations_f32;
using radixserve_cpu::check_panel;

// Activation rows sharing one dequantized block, at most: R x kChains x kVecs accumulators
// stay in registers (AVX-512: 20 of 32 zmm at 5 rows, 9 rows take 2 passes instead of 3;
// 6 rows measured slower at 9 rows on Zen 4). AVX2's factored form: 4 codes, the scale and
// 2 per row (t, acc), 15 of 16 ymm at 5 rows.
#if defined(__AVX512F__) || defined(RADIXSERVE_BLOCKS_FACTORED)
constexpr int64_t kTileRows = 5;
#else
constexpr int64_t kTileRows = 4;
#endif
constexpr int64_t kGrain = 16;    // output rows per parallel_for chunk, at least
constexpr int64_t kPrefetchRows = 4;  // weight rows asked for ahead of the one in use
constexpr int64_t kChunkRows = 16;     // weight rows per chunk when activations exceed L1
constexpr int64_t kL1Bytes = 32 * 1024;  // activations up to this size stay in L1 as they are

#if defined(RADIXSERVE_BLOCKS_FACTORED)
// Where block k of 8 goes in a row's block sums: Int4Rows::offsets' lane order.
constexpr int64_t kOffsetOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};
// A row's block sums: a whole number of 8s (the dequantized form has none).
inline int64_t padded_blocks(int64_t num_blocks) { return (num_blocks + 7) / 8 * 8; }

// Every activation row's block sums (4 vectors added, then across lanes), in kOffsetOrder
// within each 8 blocks, zero past the last block: [M, padded_blocks].
inline std::vector<float> block_sums(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock, nbp = padded_blocks(nb);
  std::vector<float> sums(M * nbp, 0.f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      const Vec s = vadd(vadd(vload(xb), vload(xb + kLanes)),
                         vadd(vload(xb + 2 * kLanes), vload(xb + 3 * kLanes)));
      sums[r * nbp + b / 8 * 8 + kOffsetOrder[b % 8]] = vsum(s);
    }
  }
  return sums;
}
#else
inline int64_t padded_blocks(int64_t) { return 0; }
#endif

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
#if defined(RADIXSERVE_BLOCKS_FACTORED)
  static constexpr bool kOffsets = true;
  // (always_inline: GCC kept an outlined copy called per block, at half the speed)
  __attribute__((always_inline)) void codes(int64_t n, int64_t b, int64_t num_blocks,
                                            Vec* c) const {
    const uint8_t* q = qs + (n * num_blocks + b) * kHalf;
    codes_int4(q, q + kHalf / 2, c);
  }
  float scale(int64_t n, int64_t b, int64_t num_blocks) const {
    return scale_min[(n * num_blocks + b) * 2];
  }
  // sum_b m_b xs_b over row n's blocks, 8 at a time (xs: the activation row's block sums in
  // kOffsetOrder, zero past the last block), in lanes.
  Vec offsets(int64_t n, int64_t num_blocks, const float* xs) const {
    const float* sm = scale_min + n * num_blocks * 2;
    Vec acc = vzero();
    for (int64_t b = 0; b < num_blocks; b += 8) {
      const auto pairs = radixserve_q8::load_pairs(
          sm + 2 * b, static_cast<int>(2 * std::min<int64_t>(8, num_blocks - b)));
      // (d, m) pairs of blocks 0-3 | 4-7 -> the m of blocks 0, 1, 4, 5, 2, 3, 6, 7
      acc = vfma(_mm256_shuffle_ps(pairs.lo, pairs.hi, 0xDD), vload(xs + b), acc);
    }
    return acc;
  }
#endif
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
#if defined(RADIXSERVE_BLOCKS_FACTORED)
  static constexpr bool kOffsets = false;
  __attribute__((always_inline)) void codes(int64_t n, int64_t b, int64_t num_blocks,
                                            Vec* c) const {
    codes_int8(qs + (n * num_blocks + b) * kBlock, c);
  }
  float scale(int64_t n, int64_t b, int64_t num_blocks) const { return scales[n * num_blocks + b]; }
#endif
};

// Block sums `offset` floats on (none in the dequantized form).
inline const float* xs(const float* xsums, int64_t offset) {
  return xsums == nullptr ? nullptr : xsums + offset;
}

// acc[c] += w * x over one block's vectors.
inline void fma_block(Vec* acc, const Vec* w, const float* x) {
  for (int64_t i = 0; i < kVecs; ++i) acc[i] = vfma(w[i], vload(x + i * kLanes), acc[i]);
}

// out[r, n] for R activation rows starting at x (fp32, row stride K), one weight row n: the
// same sums in the same order for a row whatever R is.
#if defined(RADIXSERVE_BLOCKS_FACTORED)
// The factored form (AVX2): per block, t = the codes . x (one product and three FMAs, in
// order), then acc = fma(t, d, acc); the offsets' m . (block sums of x) added at the end
// (Int4). Fewer FMAs a block than dequantizing each weight first.
template <int64_t R, typename Weights>
void dot_rows(const Weights& weights, int64_t n, int64_t num_blocks, const float* x, int64_t K,
              const float* xsums, float* out, int64_t N) {
  Vec acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = vzero();
  Vec c[kVecs];
  for (int64_t b = 0; b < num_blocks; ++b) {
    weights.codes(n, b, num_blocks, c);
    const Vec d = vset1(weights.scale(n, b, num_blocks));
    for (int64_t r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * kBlock;
      Vec t = _mm256_mul_ps(c[0], vload(xb));
      for (int64_t i = 1; i < kVecs; ++i) t = vfma(c[i], vload(xb + i * kLanes), t);
      acc[r] = vfma(t, d, acc[r]);
    }
  }
  const int64_t nbp = padded_blocks(num_blocks);
  for (int64_t r = 0; r < R; ++r) {
    Vec total = acc[r];
    if constexpr (Weights::kOffsets) {
      total = vadd(total, weights.offsets(n, num_blocks, xsums + r * nbp));
    }
    out[r * N + n] = vsum(total);
  }
}
#else
// The dequantized form: block b goes to accumulator set b % kChains of its row.
template <int64_t R, typename Weights>
void dot_rows(const Weights& weights, int64_t n, int64_t num_blocks, const float* x, int64_t K,
              const float*, float* out, int64_t N) {
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
#endif

// Every activation row against weight row n, in tiles of up to kTileRows rows (the weight
// row stays in L1 while the tiles pass over it).
template <typename Weights>
void dot_weight_row(const Weights& weights, int64_t n, int64_t num_blocks, const float* x,
                    const float* xsums, int64_t M, int64_t K, float* out, int64_t N) {
  const int64_t nbp = padded_blocks(num_blocks);
  int64_t r = 0;
  const auto tile = [&](auto rows) {  // rows: std::integral_constant, the tile's row count
    dot_rows<decltype(rows)::value>(weights, n, num_blocks, x + r * K, K, xs(xsums, r * nbp),
                                    out + r * N, N);
  };
  for (; r + kTileRows <= M; r += kTileRows) tile(std::integral_constant<int64_t, kTileRows>{});
  switch (M - r) {
#if defined(__AVX512F__) || defined(RADIXSERVE_BLOCKS_FACTORED)
    case 4: tile(std::integral_constant<int64_t, 4>{}); break;
#endif
    case 3: tile(std::integral_constant<int64_t, 3>{}); break;
    case 2: tile(std::integral_constant<int64_t, 2>{}); break;
    case 1: tile(std::integral_constant<int64_t, 1>{}); break;
    default: break;
  }
}

// Weight rows [n0, n1). With more activation rows than one tile whose rows do not all fit
// in L1 (e.g. 16 x 1536 fp32 = 96 KiB), weight rows go in chunks of kChunkRows and each tile
// of activations passes over a whole chunk before the next tile: each stays in L1.
template <typename Weights>
void dot_range(const Weights& weights, int64_t n0, int64_t n1, int64_t num_blocks,
               const float* x, const float* xsums, int64_t M, int64_t K, float* out, int64_t N) {
  const int64_t nbp = padded_blocks(num_blocks);
  if (M <= kTileRows || M * K * static_cast<int64_t>(sizeof(float)) <= kL1Bytes) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) weights.prefetch_row(n + kPrefetchRows, num_blocks);
      dot_weight_row(weights, n, num_blocks, x, xsums, M, K, out, N);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(c0 + kChunkRows, n1);
    for (int64_t r = 0; r < M; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, M - r);
      for (int64_t n = c0; n < c1; ++n) {
        if (r == 0 && n + kPrefetchRows < n1) weights.prefetch_row(n + kPrefetchRows, num_blocks);
        dot_weight_row(weights, n, num_blocks, x + r * K, xs(xsums, r * nbp), rows, K,
                       out + r * N, N);
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
#if defined(RADIXSERVE_BLOCKS_FACTORED)
  std::vector<float> sums;  // Int4's offsets only (Q8_0 has none)
  if constexpr (Weights::kOffsets) sums = block_sums(xf, M, K);
  const float* xsums = sums.empty() ? nullptr : sums.data();
#else
  const float* xsums = nullptr;
#endif
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    dot_range(weights, n0, n1, num_blocks, xf, xsums, M, K, o, N);
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
