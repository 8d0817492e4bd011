// Matmuls over GGUF weight blocks with int8 activations, out = x @ W.T, as llama.cpp computes
// them: each activation row is quantized once per call to q8 blocks (32 wide for Q4_0 / Q4_1 /
// Q8_0, 256 wide with sums per 16 for Q4_K / Q5_K / Q6_K), then every weight block meets its
// activation block in one integer dot and one or two fp32 fmas (q8_formats.h has the
// formulas, q8_simd.h the integer dots: AVX512-VNNI, AVX2, plain loops; the same bits on
// each). The weights are the bytes the fp32 kernels (block_matmul.cpp, kquant_matmul.cpp)
// read. A row's arithmetic does not depend on the other rows (row-invariant), so the same
// kernel serves decode (M = 1) and batches. Structure as block_matmul.cpp: tiles of up to
// kTileRows rows share one decoded weight block, weight rows prefetched ahead, activations
// past L1 taken tile by tile over chunks of weight rows, at::parallel_for over output rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common.h"
#include "q8_formats.h"
#include "q8_int4_x8.h"
#include "q8_kquant_x8.h"
#include "q8_kquant_x8_ymm.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace radixserve_q8;

constexpr int64_t kTileRows = 4;
constexpr int64_t kGrain = 16;
constexpr int64_t kPrefetchRows = 4;
constexpr int64_t kChunkRows = 16;
constexpr int64_t kL1Bytes = 32 * 1024;
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;  // ggml's type ids
using radixserve_kquant::kQ4KX8;  // Q4_K / Q5_K / Q6_K repacked 8 rows at a time (ours)
using radixserve_kquant::kQ5KX8;
using radixserve_kquant::kQ6KX8;
using radixserve_kquant::kX8Rows;
using radixserve_kquant::kX8Type;
constexpr int64_t kGroupGrain = 2;  // repacked groups per parallel_for chunk, at least

// Codes of one block: d = max|x| / 127, q = round-half-even(x * (1 / d)) (d = 0: all 0).
float quantize_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  const float inv = d != 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return d;
}

// The quantized activations of one call and the storage behind them.
struct Q8Buffers {
  std::vector<int8_t> qs;
  std::vector<float> d, pairs;
  std::vector<int16_t> bsums;
  Q8Acts acts;
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t block, Q8Buffers& buf) {
  const int64_t nb = K / block;
  buf.qs.resize(M * K);
  buf.d.resize(M * nb);
  buf.pairs.resize(block == kQ8Block ? 2 * M * nb : 0);
  buf.bsums.resize(block == kQ8KBlock ? M * K / 16 : 0);
  at::parallel_for(0, M * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t ab = b0; ab < b1; ++ab) {
      int8_t* q = buf.qs.data() + ab * block;
      const float d = buf.d[ab] = quantize_block(x + ab * block, block, q);
      if (block == kQ8Block) {
        int32_t s = 0;
        for (int64_t i = 0; i < block; ++i) s += q[i];
        buf.pairs[2 * ab] = d;
        buf.pairs[2 * ab + 1] = d * static_cast<float>(s);  // the sum exact (< 2^24), times d
        continue;
      }
      for (int64_t g = 0; g < block / 16; ++g) {
        int32_t s = 0;
        for (int64_t i = 0; i < 16; ++i) s += q[16 * g + i];
        buf.bsums[ab * 16 + g] = static_cast<int16_t>(s);
      }
    }
  });
  buf.acts = Q8Acts{buf.qs.data(), buf.d.data(), buf.pairs.data(), buf.bsums.data(), K, nb};
}

// out[r0 + r, n] for R rows from r0 against weight row n, group by group of blocks, then one
// fixed reduction of the two lane sets, the offsets' lanes and the min terms.
template <int64_t R, typename F>
void dot_rows(const F& f, int64_t n, const Q8Acts& a, int64_t r0, float* out, int64_t N) {
  constexpr int kStep = F::kBlocksPerGroup;
  RowAcc acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = RowAcc{dzero(), pzero(), 0.f};
  int64_t b = 0;
  for (; b + kStep <= a.num_blocks; b += kStep) f.template group<R>(n, b, kStep, a, r0, acc);
  if (b < a.num_blocks)
    f.template group<R>(n, b, static_cast<int>(a.num_blocks - b), a, r0, acc);
  for (int64_t r = 0; r < R; ++r) {
    const float dots = dsum(acc[r].lanes);
    out[(r0 + r) * N + n] = (dots + odd_sum(acc[r].offsets)) + acc[r].scalar;
  }
}

template <typename F>
void dot_weight_row(const F& f, int64_t n, const Q8Acts& a, int64_t r0, int64_t rows, float* out,
                    int64_t N) {
  int64_t r = r0;
  for (; r + kTileRows <= r0 + rows; r += kTileRows) dot_rows<kTileRows>(f, n, a, r, out, N);
  switch (r0 + rows - r) {
    case 3: dot_rows<3>(f, n, a, r, out, N); break;
    case 2: dot_rows<2>(f, n, a, r, out, N); break;
    case 1: dot_rows<1>(f, n, a, r, out, N); break;
    default: break;
  }
}

template <typename F>
void dot_range(const F& f, int64_t n0, int64_t n1, const Q8Acts& a, int64_t M, float* out,
               int64_t N) {
  if (M <= kTileRows || M * a.K <= kL1Bytes) {
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) f.prefetch_row(n + kPrefetchRows, a.num_blocks);
      dot_weight_row(f, n, a, 0, M, out, N);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(c0 + kChunkRows, n1);
    for (int64_t r = 0; r < M; r += kTileRows) {
      for (int64_t n = c0; n < c1; ++n) {
        if (r == 0 && n + kPrefetchRows < n1) f.prefetch_row(n + kPrefetchRows, a.num_blocks);
        dot_weight_row(f, n, a, r, std::min(kTileRows, M - r), out, N);
      }
    }
  }
}

void check_x(const at::Tensor& x, int64_t block, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a contiguous float32 or bfloat16 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % block == 0, op, ": K must be a multiple of ", block, ", got ", x.size(1));
}

template <typename F>
at::Tensor run(const at::Tensor& x, const F& f, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> scratch;
  Q8Buffers buf;
  quantize_rows(radixserve_cpu::activations_f32(x, scratch), M, K, F::kBlock, buf);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    dot_range(f, n0, n1, buf.acts, M, o, N);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// dot(tile, group, m) over every group of 8 weight rows and every tile of activation rows
// (tile: std::integral_constant of its rows, up to kTileRows).
template <typename Dot>
void over_x8_groups(int64_t M, int64_t num_groups, Dot&& dot) {
  at::parallel_for(0, num_groups, kGroupGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t m = 0;
      for (; m + kTileRows <= M; m += kTileRows)
        dot(std::integral_constant<int, kTileRows>{}, g, m);
      switch (M - m) {
        case 3: dot(std::integral_constant<int, 3>{}, g, m); break;
        case 2: dot(std::integral_constant<int, 2>{}, g, m); break;
        case 1: dot(std::integral_constant<int, 1>{}, g, m); break;
        default: break;
      }
    }
  });
}

// Repacked K-quants (kquant_blocks.h; X the 8-row kernel, L the layout, Rows the row
// kernel): with AVX-512 or AVX2 X on every group and every activation row, the rows past the
// last group on Rows; else (portable) every group unpacked for Rows. The same bits either way.
#if defined(RADIXSERVE_Q8_ZMM) || defined(RADIXSERVE_Q8_YMM)
#define RADIXSERVE_KQUANT_X8 1
#endif
template <typename X, typename L, typename Rows>
at::Tensor run_x8(const at::Tensor& x, const uint8_t* w, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kQ8KBlock;
  std::vector<float> scratch;
  Q8Buffers buf;
  quantize_rows(radixserve_cpu::activations_f32(x, scratch), M, K, kQ8KBlock, buf);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = nb * L::kBytes, grouped = N / kX8Rows * kX8Rows;
#if defined(RADIXSERVE_KQUANT_X8)
  over_x8_groups(M, grouped / kX8Rows, [&](auto tile, int64_t g, int64_t m) {
    float* og = o + g * kX8Rows + m * N;
    x8_dot<X, decltype(tile)::value>(w + g * kX8Rows * row_bytes, buf.acts, m, og, N);
  });
  if (grouped < N)
    dot_range(Rows{{}, w + grouped * row_bytes}, 0, N - grouped, buf.acts, M, o + grouped, N);
#else
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    radixserve_kquant::for_rows_unpacked<L>(
        w, N, nb, n0, n1, [&](const uint8_t* rows, int64_t first, int64_t count) {
          dot_range(Rows{{}, rows}, 0, count, buf.acts, M, o + first, N);
        });
  });
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor int4_block_mm_q8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale_min) {
  check_x(x, kQ8Block, "int4_block_mm_q8");
  const int64_t N = qs.size(0), K = x.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) * 2 == K,
              "int4_block_mm_q8: qs must be a contiguous uint8 [N, K / 2] tensor");
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == N &&
                  scale_min.size(1) * kQ8Block == K && scale_min.size(2) == 2,
              "int4_block_mm_q8: scale_min must be a contiguous float32 [N, K / 32, 2] tensor");
  return run(x, Int4Rows{qs.data_ptr<uint8_t>(), scale_min.data_ptr<float>()}, N);
}

// Repacked Q4_0 / Q4_1 (q8_int4_x8.h): with AVX-512 or AVX2 the 8-row kernel on every group,
// the rows past the last group unpacked for Int4Rows; else (portable) every row unpacked.
at::Tensor int4_x8_mm_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  check_x(x, kQ8Block, "int4_x8_mm_q8");
  TORCH_CHECK(qtype == kQ40X8 || qtype == kQ41X8, "int4_x8_mm_q8: qtype ", qtype,
              " is not repacked Q4_0 (1002) or Q4_1 (1003)");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const Int4X8Layout L{qtype == kQ41X8, K / kQ8Block};
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == L.row_bytes(),
              "int4_x8_mm_q8: blocks must be a contiguous uint8 [N, K / 32 * ", L.block_bytes(),
              "] tensor");
  std::vector<float> scratch;
  Q8Buffers buf;
  quantize_rows(radixserve_cpu::activations_f32(x, scratch), M, K, kQ8Block, buf);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  auto rows = [&](int64_t n0, int64_t n1) {
    for_int4_rows_unpacked(w, L, N, n0, n1, [&](const uint8_t* qs, const float* sm, int64_t first,
                                                int64_t count) {
      dot_range(Int4Rows{qs, sm}, 0, count, buf.acts, M, o + first, N);
    });
  };
  const int64_t grouped = N / kX8Rows * kX8Rows;
#if defined(RADIXSERVE_Q8_ZMM) || defined(RADIXSERVE_Q8_YMM)
  over_x8_groups(M, grouped / kX8Rows, [&](auto tile, int64_t g, int64_t m) {
    constexpr int R = decltype(tile)::value;
    const uint8_t* group = w + g * kX8Rows * L.row_bytes();
    float* og = o + g * kX8Rows + m * N;
    if (L.has_min) int4_x8_dot<true, R>(group, buf.acts, m, og, N);
    else int4_x8_dot<false, R>(group, buf.acts, m, og, N);
  });
  rows(grouped, N);
#else
  at::parallel_for(0, N, kGrain, rows);
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor int8_block_mm_q8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales) {
  check_x(x, kQ8Block, "int8_block_mm_q8");
  const int64_t N = qs.size(0), K = x.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) == K,
              "int8_block_mm_q8: qs must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) * kQ8Block == K,
              "int8_block_mm_q8: scales must be a contiguous float32 [N, K / 32] tensor");
  return run(x, Int8Rows{qs.data_ptr<int8_t>(), scales.data_ptr<float>()}, N);
}

at::Tensor kquant_mm_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  check_x(x, kQ8KBlock, "kquant_mm_q8");
  TORCH_CHECK(qtype == kQ4K || qtype == kQ5K || qtype == kQ6K || qtype == kQ4KX8 ||
                  qtype == kQ5KX8 || qtype == kQ6KX8,
              "kquant_mm_q8: ggml type ", qtype,
              " is not Q4_K (12), Q5_K (13), Q6_K (14) or repacked (1012 / 1013 / 1014)");
  const int64_t base = qtype > kX8Type ? qtype - kX8Type : qtype;
  const int64_t bytes = base == kQ5K ? 176 : (base == kQ6K ? 210 : 144);
  const int64_t N = blocks.size(0), K = x.size(1);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(1) * kQ8KBlock == K * bytes,
              "kquant_mm_q8: blocks must be a contiguous uint8 [N, K / 256 * ", bytes, "] tensor");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  using radixserve_kquant::Q4KX8Layout;
  using radixserve_kquant::Q5KX8Layout;
  using radixserve_kquant::Q6KX8Layout;
#if defined(RADIXSERVE_KQUANT_X8)
  if (qtype == kQ4KX8) return run_x8<Q4KX8, Q4KX8Layout, Q4KRows>(x, w, N);
  if (qtype == kQ5KX8) return run_x8<Q5KX8, Q5KX8Layout, Q5KRows>(x, w, N);
  if (qtype == kQ6KX8) return run_x8<Q6KX8, Q6KX8Layout, Q6KRows>(x, w, N);
#else
  if (qtype == kQ4KX8) return run_x8<void, Q4KX8Layout, Q4KRows>(x, w, N);
  if (qtype == kQ5KX8) return run_x8<void, Q5KX8Layout, Q5KRows>(x, w, N);
  if (qtype == kQ6KX8) return run_x8<void, Q6KX8Layout, Q6KRows>(x, w, N);
#endif
  if (qtype == kQ4K) return run(x, Q4KRows{{}, w}, N);
  if (qtype == kQ5K) return run(x, Q5KRows{{}, w}, N);
  return run(x, Q6KRows{{}, w}, N);
}

// The activations as the kernels see them: codes [M, K] int8 and scales [M, K / block].
std::tuple<at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block == kQ8Block || block == kQ8KBlock, "q8_quantize: block must be 32 or 256");
  check_x(x, block, "q8_quantize");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> scratch;
  Q8Buffers buf;
  quantize_rows(radixserve_cpu::activations_f32(x, scratch), M, K, block, buf);
  at::Tensor qs = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / block}, x.options().dtype(at::kFloat));
  std::copy(buf.qs.begin(), buf.qs.end(), qs.data_ptr<int8_t>());
  std::copy(buf.d.begin(), buf.d.end(), d.data_ptr<float>());
  return {qs, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("int4_block_mm_q8(Tensor x, Tensor qs, Tensor scale_min) -> Tensor");
  m.def("int8_block_mm_q8(Tensor x, Tensor qs, Tensor scales) -> Tensor");
  m.def("kquant_mm_q8(Tensor x, Tensor blocks, int qtype) -> Tensor");
  m.def("int4_x8_mm_q8(Tensor x, Tensor blocks, int qtype) -> Tensor");
  m.def("q8_quantize(Tensor x, int block) -> (Tensor, Tensor)");
  // Which integer dot the int8-activation kernels were built with (avx512_vnni, avx2, portable).
  m.def("int_dot_level() -> str", [] { return std::string(kIntDot); });
  // Whether repacked K-quants run on their 8-row kernels here (AVX-512 or AVX2).
  m.def("kquant_x8_native() -> bool", [] {
#if defined(RADIXSERVE_KQUANT_X8)
    return true;
#else
    return false;
#endif
  });
  // Whether repacked Q4_0 / Q4_1 run on their 8-row kernels here (AVX-512 or AVX2).
  m.def("int4_x8_native() -> bool", [] {
#if defined(RADIXSERVE_Q8_ZMM) || defined(RADIXSERVE_Q8_YMM)
    return true;
#else
    return false;
#endif
  });
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("int4_block_mm_q8", &int4_block_mm_q8);
  m.impl("int8_block_mm_q8", &int8_block_mm_q8);
  m.impl("kquant_mm_q8", &kquant_mm_q8);
  m.impl("int4_x8_mm_q8", &int4_x8_mm_q8);
  m.impl("q8_quantize", &q8_quantize);
}
