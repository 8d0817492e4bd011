// Batch-invariant dense matmul, out = x @ W.T, for --enable-deterministic-inference.
//
// Every output element is one fixed-order fp32 chain over the input dimension:
//     acc = 0;  for k in 0 .. K-1:  acc = fma(x[m, k], w[n, k], acc)
// whatever the number of rows M, the tile a row lands in, the thread it runs on, or the SIMD
// level of the build (AVX512 and AVX2 intrinsics and the portable std::fma loop round
// alike). Threads split the output features (groups of 64 columns of W), never the
// reduction, so a single row still uses every thread. bf16 activations and weights are
// widened to fp32 exactly; the arithmetic is the same as for fp32.
//
// The weight is packed once at load (model/quant/batch_invariant.py: pack_dense_weight):
//     W [N, K] -> packed [Np / 16, K, 16], N padded with zero rows to Np, a multiple of 64
// so 16 consecutive output features of one k are one 64-byte vector. A micro-kernel keeps
// R rows x 64 columns of accumulators in registers and streams the group's four panels.
// The K loop runs in blocks of kKBlock; between blocks the partial sums wait in the output
// (an exact fp32 store and load), so a group's weights are read once from L2 for every tile
// of rows. docs/performance.md ("The batch-invariant dense matmul") has the numbers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <vector>

namespace {

using namespace radixserve_cpu::simd;
using radixserve_cpu::activations_f32;
using radixserve_cpu::simd::vload;  // beside the bf16 overload below

constexpr int64_t kPanel = 16;   // output features per packed panel
constexpr int64_t kGroup = 64;   // output features per parallel work item (4 panels)
constexpr int64_t kKBlock = 512; // inputs per K block (a group's block: 128 KiB of fp32)
constexpr int64_t kTileRows = 4; // activation rows per micro-kernel call

// simd.h's vectors, plus a load of kLanes bf16 weights widened exactly to fp32, and how many
// passes over a 64-column group the level's registers need.
#if defined(__AVX512F__)
constexpr int64_t kHalves = 1;  // registers hold all 64 columns
inline Vec vload(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kHalves = 2;  // 16 ymm registers: 32 columns at a time
inline Vec vload(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#else
constexpr int64_t kHalves = 1;
inline Vec vload(const c10::BFloat16* p) {
  Vec r;
  for (int64_t j = 0; j < kLanes; ++j) r.v[j] = static_cast<float>(p[j]);
  return r;
}
#endif
constexpr int64_t kCols = kGroup / kHalves;       // columns one micro-kernel call holds
constexpr int64_t kVecs = kCols / kLanes;         // accumulator vectors per row

// Rows [0, R) of x (fp32, row stride K) times columns [c0, c0 + kCols) of one group, over
// inputs [k0, k1): accumulators start at zero (first block) or from `out`, and end there.
template <int64_t R, typename W>
void micro_kernel(const float* x, int64_t K, const W* group, int64_t c0, int64_t k0,
                  int64_t k1, float* out, int64_t ldo) {
  Vec acc[R][kVecs];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVecs; ++v)
      acc[r][v] = k0 == 0 ? vzero() : vload(out + r * ldo + c0 + v * kLanes);
  const W* panel[kVecs];  // where vector v of the columns starts in the packed group
  for (int64_t v = 0; v < kVecs; ++v) {
    const int64_t col = c0 + v * kLanes;
    panel[v] = group + (col / kPanel) * K * kPanel + col % kPanel;
  }
  for (int64_t k = k0; k < k1; ++k) {
    Vec xb[R];
    for (int64_t r = 0; r < R; ++r) xb[r] = vset1(x[r * K + k]);
    for (int64_t v = 0; v < kVecs; ++v) {
      const Vec w = vload(panel[v] + k * kPanel);
      for (int64_t r = 0; r < R; ++r) acc[r][v] = vfma(xb[r], w, acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kVecs; ++v) vstore(out + r * ldo + c0 + v * kLanes, acc[r][v]);
}

// Rows [0, M) over one K block of one group, in tiles of up to kTileRows rows.
template <typename W>
void group_block(const float* x, int64_t M, int64_t K, const W* group, int64_t k0, int64_t k1,
                 float* out, int64_t ldo) {
  for (int64_t h = 0; h < kHalves; ++h) {
    const int64_t c0 = h * kCols;
    int64_t r = 0;
    for (; r + kTileRows <= M; r += kTileRows)
      micro_kernel<kTileRows>(x + r * K, K, group, c0, k0, k1, out + r * ldo, ldo);
    switch (M - r) {
      case 3: micro_kernel<3>(x + r * K, K, group, c0, k0, k1, out + r * ldo, ldo); break;
      case 2: micro_kernel<2>(x + r * K, K, group, c0, k0, k1, out + r * ldo, ldo); break;
      case 1: micro_kernel<1>(x + r * K, K, group, c0, k0, k1, out + r * ldo, ldo); break;
      default: break;
    }
  }
}

template <typename W>
void run_groups(const float* x, int64_t M, int64_t K, const W* packed, int64_t num_groups,
                float* out, int64_t ldo) {
  const int64_t group_elems = kGroup * K;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k0 = 0; k0 < K; k0 += kKBlock)
        group_block(x, M, K, packed + g * group_elems, k0, std::min(k0 + kKBlock, K),
                    out + g * kGroup, ldo);
  });
}

// x [M, K] fp32 / bf16 @ W.T with W packed as [Np / 16, K, 16] fp32 / bf16 -> [M, N] fp32.
at::Tensor dense_mm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "dense_mm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "dense_mm: x must be a contiguous float32 or bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == K &&
                  packed.size(2) == kPanel && packed.size(0) % (kGroup / kPanel) == 0 &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "dense_mm: packed must be a contiguous float32 or bfloat16 [Np / 16, K, 16] "
              "tensor, Np a multiple of 64, K = x.size(1)");
  const int64_t padded = packed.size(0) * kPanel;
  TORCH_CHECK(N > 0 && N <= padded && padded - N < kGroup,
              "dense_mm: N must be the packed weight's row count (", padded - kGroup + 1, "..",
              padded, "), got ", N);
  std::vector<float> scratch;
  const float* xf = activations_f32(x, scratch);
  at::Tensor out = at::empty({M, padded}, x.options().dtype(at::kFloat));
  if (M == 0) return out.narrow(1, 0, N);
  const int64_t num_groups = padded / kGroup;
  if (packed.scalar_type() == at::kFloat)
    run_groups(xf, M, K, packed.data_ptr<float>(), num_groups, out.data_ptr<float>(), padded);
  else
    run_groups(xf, M, K, packed.data_ptr<c10::BFloat16>(), num_groups, out.data_ptr<float>(),
               padded);
  return padded == N ? out : out.narrow(1, 0, N).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("dense_mm(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("dense_mm", &dense_mm); }
