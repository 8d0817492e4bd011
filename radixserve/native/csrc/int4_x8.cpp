// Q4_0 / Q4_1 weights in the repacked 8-row layout (q8_int4_x8.h; q8_matmul.cpp multiplies
// them): packing the loader's row layout into it, unpacking chosen rows back (the row kernels'
// way onto repacked bytes) and dequantizing a panel of rows in place for prefill's dense
// matmul (dense_panels.py), fp32 or bf16, the values the block kernels multiply.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "block_dequant.h"
#include "common.h"
#include "q8_int4_x8.h"

#include <algorithm>
#include <cstring>
#include <tuple>

namespace {

using namespace radixserve_blocks;
using namespace radixserve_q8;
using radixserve_cpu::check_panel;
using radixserve_kquant::half_at;
using radixserve_kquant::kX8Rows;

constexpr int64_t kGrain = 16;  // weight rows per parallel_for chunk, at least

// Repacked Q4_0 / Q4_1 (q8_int4_x8.h) read a row at a time as Int4Rows reads the row layout:
// the same codes, scale and offset (fp16 values widened), so the same fp32 weights. A chunk's
// blocks lie a fixed step apart, so only each chunk's offsets are computed.
struct Int4X8Rows {
  const uint8_t* w;
  Int4X8Layout L;
  int64_t N;
  template <typename T>
  void row(int64_t n, T* dst) const {
    const int64_t chunk = kX8Chunk;
    for (int64_t b0 = 0; b0 < L.nb; b0 += chunk) {
      int64_t base;
      const Int4X8At at = L.at(N, n, b0, base);
      const bool grouped = n < N / kX8Rows * kX8Rows;
      const int64_t scale_step = grouped ? 16 : L.block_bytes();
      const int64_t code_step = grouped ? 128 : L.block_bytes();
      const uint8_t* p = w + base;
      for (int64_t j = 0; j < std::min(chunk, L.nb - b0); ++j) {
        const float d = half_at(p + at.d + j * scale_step);
        const float m = L.has_min ? half_at(p + at.m + j * scale_step) : 0.f - 8.f * d;
        Vec v[kVecs];
        dequant_int4(p + at.lo + j * code_step, p + at.hi + j * code_step, d, m, v);
        T* out = dst + (b0 + j) * kBlock;
        for (int64_t i = 0; i < kVecs; ++i) vstore(out + i * kLanes, v[i]);
      }
    }
  }
};

// The row layout (qs [N, K / 2] uint8, scale_min [N, K / 32, 2] fp32) repacked 8 rows at a
// time as Q4_0 (1002: every offset -8 x its scale) or Q4_1 (1003); every scale and offset
// must be an fp16 value (a GGUF file's are).
at::Tensor int4_repack_x8(const at::Tensor& qs, const at::Tensor& scale_min, int64_t qtype) {
  TORCH_CHECK(qtype == kQ40X8 || qtype == kQ41X8, "int4_repack_x8: qtype ", qtype,
              " is not repacked Q4_0 (1002) or Q4_1 (1003)");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 &&
                  scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
                  scale_min.dim() == 3 && scale_min.size(0) == qs.size(0) &&
                  scale_min.size(1) * 16 == qs.size(1) && scale_min.size(2) == 2,
              "int4_repack_x8: qs must be uint8 [N, K / 2], scale_min float32 [N, K / 32, 2]");
  const int64_t N = qs.size(0);
  const Int4X8Layout L{qtype == kQ41X8, scale_min.size(1)};
  const float* sm = scale_min.data_ptr<float>();
  for (int64_t i = 0; i < N * L.nb; ++i) {
    const float d = sm[2 * i], m = sm[2 * i + 1];
    const bool exact = static_cast<float>(c10::Half(d)) == d &&
                       (L.has_min ? static_cast<float>(c10::Half(m)) == m : m == 0.f - 8.f * d);
    TORCH_CHECK(exact, "int4_repack_x8: block ", i, "'s scale / offset (", d, ", ", m,
                ") is not ", L.has_min ? "an fp16 pair" : "an fp16 scale with offset -8 x it");
  }
  at::Tensor out = at::empty({N, L.row_bytes()}, qs.options());
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    repack_int4_rows(qs.data_ptr<uint8_t>(), sm, L, N, n0, n1, out.data_ptr<uint8_t>());
  });
  return out;
}

// Weight rows row0 .. row0 + out.size(0) of repacked Q4_0 / Q4_1 into `out` (fp32 or bf16
// [rows, K]), read in place: the values int4_block_dequantize_into gives on the row layout
// (int4_unpack_x8's rows).
void int4_x8_dequantize_into(const at::Tensor& blocks, int64_t qtype, int64_t row0,
                             at::Tensor out) {
  TORCH_CHECK(qtype == kQ40X8 || qtype == kQ41X8,
              "int4_x8_dequantize_into: qtype ", qtype,
              " is not repacked Q4_0 (1002) or Q4_1 (1003)");
  const int64_t bytes = qtype == kQ41X8 ? 20 : 18;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) % bytes == 0,
              "int4_x8_dequantize_into: blocks must be a contiguous uint8 [N, K / 32 * ", bytes,
              "] tensor");
  const Int4X8Layout L{qtype == kQ41X8, blocks.size(1) / bytes};
  check_panel(out, row0, blocks.size(0), L.nb * kBlock, "int4_x8_dequantize_into");
  const Int4X8Rows weights{blocks.data_ptr<uint8_t>(), L, blocks.size(0)};
  radixserve_cpu::with_panel_data(out, [&](auto* o) {
    at::parallel_for(0, out.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) weights.row(row0 + r, o + r * L.nb * kBlock);
    });
  });
}

// Rows `rows` (int64, 1-D) of repacked Q4_0 / Q4_1 in the row layout: (qs, scale_min).
std::tuple<at::Tensor, at::Tensor> int4_unpack_x8(const at::Tensor& blocks, int64_t qtype,
                                                  const at::Tensor& rows) {
  TORCH_CHECK(qtype == kQ40X8 || qtype == kQ41X8, "int4_unpack_x8: qtype ", qtype,
              " is not repacked Q4_0 (1002) or Q4_1 (1003)");
  const Int4X8Layout L{qtype == kQ41X8, 1};
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) % L.block_bytes() == 0,
              "int4_unpack_x8: blocks must be a contiguous uint8 [N, K / 32 * ",
              L.block_bytes(), "] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "int4_unpack_x8: rows must be a contiguous int64 [n] tensor");
  const int64_t N = blocks.size(0), count = rows.size(0);
  const Int4X8Layout layout{L.has_min, blocks.size(1) / L.block_bytes()};
  const int64_t* index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(0 <= index[i] && index[i] < N, "int4_unpack_x8: row ", index[i], " of ", N);
  at::Tensor qs = at::empty({count, layout.nb * 16}, blocks.options());
  at::Tensor sm = at::empty({count, layout.nb, 2}, blocks.options().dtype(at::kFloat));
  at::parallel_for(0, count, kGrain, [&](int64_t i0, int64_t i1) {
    unpack_int4_rows(blocks.data_ptr<uint8_t>(), layout, N, index + i0, i1 - i0,
                     qs.data_ptr<uint8_t>() + i0 * layout.nb * 16,
                     sm.data_ptr<float>() + i0 * layout.nb * 2);
  });
  return {qs, sm};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("int4_repack_x8(Tensor qs, Tensor scale_min, int qtype) -> Tensor");
  m.def("int4_unpack_x8(Tensor blocks, int qtype, Tensor rows) -> (Tensor, Tensor)");
  m.def("int4_x8_dequantize_into(Tensor blocks, int qtype, int row0, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("int4_repack_x8", &int4_repack_x8);
  m.impl("int4_unpack_x8", &int4_unpack_x8);
  m.impl("int4_x8_dequantize_into", &int4_x8_dequantize_into);
}
