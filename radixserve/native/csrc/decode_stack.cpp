// A decode or short in-place extend step's decoder layers in one call (model/cpu_decode_stack.py
// builds it).
//
// An eager step pays Python around its ~12 ops a layer: the module calls, the quantized
// layers' checks, the attention backend's routing, each torch.ops call's argument parsing
// (~2-3 ms of a ~36 ms 1B step on one core; docs/performance.md, "The decode stack").
// DecodeStack holds, per layer, what those modules would pass to their ops (norm weights, each
// projection's parts: the op and its weight tensors) and calls the same ops, through the
// dispatcher, in the same order with the same arguments:
//
//   layer 0: residual = hidden; hidden = rms_norm(hidden)        later: add_rms_norm(hidden!)
//   qkv = qkv_proj(hidden); rope_store(qkv!, k_pool!, v_pool!); q = qkv[:, :H*D] (contiguous)
//   o = o_proj(attention(q)); add_rms_norm(o!, residual!)
//   hidden = down_proj(silu_mul(gate_up_proj(o)))
//
// where attention is paged_decode (`forward`: one token per request) or paged_extend
// (`forward_extend`: every request's new tokens in place over its pages, a verify's chain or
// draft tree included), so a step's results are the modules' bits
// (tests/test_cpu_decode_stack.py). Both also return the residual stream entering each layer
// of `aux_layers` (EAGLE's captured hidden states), as LlamaForCausalLM.forward_layers takes
// them. A projection is one or more parts (a StackedLinear's formats) concatenated along the
// features; a part is one kernel call, then its row order (index_select) and its bias, as the
// layer does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// A projection part's kernel (the call its layer's `_matmul` makes for a few rows).
enum PartKind : int64_t {
  kDense = 0,     // at::linear(x, a, bias): an fp layer (nn.Linear)
  kKQuant = 1,    // kquant_mm(x, a, qtype)
  kKQuantQ8 = 2,  // kquant_mm_q8(x, a, qtype)
  kInt4 = 3,      // int4_block_mm(x, a = qs, b = scale_min)
  kInt4Q8 = 4,    // int4_block_mm_q8(x, qs, scale_min)
  kInt4X8Q8 = 5,  // int4_x8_mm_q8(x, a, qtype)
  kInt8 = 6,      // int8_block_mm(x, a = qs, b = scales)
  kInt8Q8 = 7,    // int8_block_mm_q8(x, qs, scales)
  kPacked = 8,    // dense_mm(x, a = packed weight, qtype = out features): the packed kernel
};
constexpr int64_t kNumKinds = 9;
enum Projection : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
constexpr int64_t kNumProjections = 4;

using Opt = std::optional<at::Tensor>;
using MmType = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using MmPair = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = void(at::Tensor&, at::Tensor&, const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);
using RopeStore = void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                       at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, const Opt&,
                       const Opt&, double);
using PagedDecode = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                               int64_t, const Opt&, double);
using PagedExtend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                               const Opt&, double);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The ops, looked up once (the extension registers them all when it loads).
struct Ops {
  c10::TypedOperatorHandle<MmType> dense_mm = find_op<MmType>("radixserve_cpu::dense_mm");
  c10::TypedOperatorHandle<MmType> kquant_mm = find_op<MmType>("radixserve_cpu::kquant_mm");
  c10::TypedOperatorHandle<MmType> kquant_mm_q8 = find_op<MmType>("radixserve_cpu::kquant_mm_q8");
  c10::TypedOperatorHandle<MmType> int4_x8_mm_q8 =
      find_op<MmType>("radixserve_cpu::int4_x8_mm_q8");
  c10::TypedOperatorHandle<MmPair> int4_mm = find_op<MmPair>("radixserve_cpu::int4_block_mm");
  c10::TypedOperatorHandle<MmPair> int4_mm_q8 =
      find_op<MmPair>("radixserve_cpu::int4_block_mm_q8");
  c10::TypedOperatorHandle<MmPair> int8_mm = find_op<MmPair>("radixserve_cpu::int8_block_mm");
  c10::TypedOperatorHandle<MmPair> int8_mm_q8 =
      find_op<MmPair>("radixserve_cpu::int8_block_mm_q8");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("radixserve_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm =
      find_op<AddRmsNorm>("radixserve_cpu::add_rms_norm");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find_op<SiluMul>("radixserve_cpu::silu_mul");
  c10::TypedOperatorHandle<RopeStore> rope_store =
      find_op<RopeStore>("radixserve_cpu::rope_store");
  c10::TypedOperatorHandle<PagedDecode> paged_decode =
      find_op<PagedDecode>("radixserve_cpu::paged_decode");
  c10::TypedOperatorHandle<PagedExtend> paged_extend =
      find_op<PagedExtend>("radixserve_cpu::paged_extend");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

struct Part {
  int64_t kind;
  at::Tensor a;
  Opt b;  // scale_min / scales of the int4 / int8 row layouts
  int64_t qtype;
  Opt row_order;  // output j is kernel row row_order[j] (llama.cpp's permuted q / k rows)
  Opt bias;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Opt q_norm, k_norm;
  std::array<std::vector<Part>, kNumProjections> projections;
};

at::Tensor run_part(const Part& p, const at::Tensor& x) {
  const Ops& o = ops();
  if (p.kind == kDense) return at::linear(x, p.a, p.bias);
  at::Tensor out;
  switch (p.kind) {
    case kKQuant: out = o.kquant_mm.call(x, p.a, p.qtype); break;
    case kKQuantQ8: out = o.kquant_mm_q8.call(x, p.a, p.qtype); break;
    case kInt4: out = o.int4_mm.call(x, p.a, *p.b); break;
    case kInt4Q8: out = o.int4_mm_q8.call(x, p.a, *p.b); break;
    case kInt4X8Q8: out = o.int4_x8_mm_q8.call(x, p.a, p.qtype); break;
    case kInt8: out = o.int8_mm.call(x, p.a, *p.b); break;
    case kPacked: out = o.dense_mm.call(x, p.a, p.qtype); break;
    default: out = o.int8_mm_q8.call(x, p.a, *p.b); break;
  }
  if (p.row_order.has_value()) out = out.index_select(1, *p.row_order);
  return p.bias.has_value() ? out + *p.bias : out;
}

at::Tensor project(const std::vector<Part>& parts, const at::Tensor& x) {
  if (parts.size() == 1) return run_part(parts[0], x);
  std::vector<at::Tensor> outs;
  outs.reserve(parts.size());
  for (const Part& p : parts) outs.push_back(run_part(p, x));
  return at::cat(outs, -1);
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim, sliding_window;
  double eps, scale, logit_cap;
  std::vector<Layer> layers;

  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              int64_t sliding_window, double scale, double logit_cap)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim),
        sliding_window(sliding_window), eps(eps), scale(scale), logit_cap(logit_cap) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "DecodeStack: num_heads must be a positive multiple of num_kv_heads");
    ops();  // every op it calls exists, or this fails now rather than in a step
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, Opt q_norm, Opt k_norm) {
    layers.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm),
                           std::move(k_norm), {}});
  }

  // Appends a part to projection `projection` (kQkv .. kDown) of the last layer added.
  void add_part(int64_t projection, int64_t kind, at::Tensor a, Opt b, int64_t qtype,
                Opt row_order, Opt bias) {
    TORCH_CHECK(!layers.empty(), "DecodeStack.add_part: add_layer first");
    TORCH_CHECK(projection >= 0 && projection < kNumProjections,
                "DecodeStack.add_part: projection must be 0..3, got ", projection);
    TORCH_CHECK(kind >= 0 && kind < kNumKinds, "DecodeStack.add_part: unknown kind ", kind);
    const bool pair = kind == kInt4 || kind == kInt4Q8 || kind == kInt8 || kind == kInt8Q8;
    TORCH_CHECK(!pair || b.has_value(), "DecodeStack.add_part: kind ", kind, " needs b");
    layers.back().projections[projection].push_back(
        Part{kind, std::move(a), std::move(b), qtype, std::move(row_order), std::move(bias)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // hidden: the embeddings [tokens, hidden] fp32 (one decode token per request); cos / sin:
  // [tokens, (1,) head_dim] fp32; slots: [tokens] int64, each token's new K/V slot; k_pools /
  // v_pools: each layer's [slots, kv_heads, head_dim]; page_table / seq_lens as paged_decode;
  // aux_layers: ascending layer indices in 0 .. layers. Returns (the last layer's MLP output,
  // the residual before it: the final norm adds them), then the residual stream entering each
  // aux layer (the layer count: after the last).
  std::vector<at::Tensor> forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                                  at::Tensor slots, std::vector<at::Tensor> k_pools,
                                  std::vector<at::Tensor> v_pools, at::Tensor page_table,
                                  at::Tensor seq_lens, int64_t page_size,
                                  std::vector<int64_t> aux_layers) {
    const Opt no_rows;
    auto attend = [&](const at::Tensor& q, int64_t i) {
      return ops().paged_decode.call(q, k_pools[i], v_pools[i], page_table, seq_lens, page_size,
                                     sliding_window, scale, 0, no_rows, logit_cap);
    };
    return run(std::move(hidden), cos, sin, slots, k_pools, v_pools, aux_layers, attend);
  }

  // As `forward` for a batch whose requests all extend in place (paged_extend's arguments:
  // their new tokens' q_starts, prefix_lens, extend_lens, page_rows, and a draft tree's
  // tree_parents).
  std::vector<at::Tensor> forward_extend(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                                         at::Tensor slots, std::vector<at::Tensor> k_pools,
                                         std::vector<at::Tensor> v_pools, at::Tensor page_table,
                                         at::Tensor q_starts, at::Tensor prefix_lens,
                                         at::Tensor extend_lens, at::Tensor page_rows,
                                         Opt tree_parents, int64_t page_size,
                                         std::vector<int64_t> aux_layers) {
    auto attend = [&](const at::Tensor& q, int64_t i) {
      return ops().paged_extend.call(q, k_pools[i], v_pools[i], page_table, q_starts,
                                     prefix_lens, extend_lens, page_rows, page_size,
                                     sliding_window, scale, tree_parents, logit_cap);
    };
    return run(std::move(hidden), cos, sin, slots, k_pools, v_pools, aux_layers, attend);
  }

 private:
  template <typename Attend>
  std::vector<at::Tensor> run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& slots, std::vector<at::Tensor>& k_pools,
                              std::vector<at::Tensor>& v_pools,
                              const std::vector<int64_t>& aux_layers, const Attend& attend) {
    const Ops& o = ops();
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0, "DecodeStack.forward: no layers");
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == L &&
                    static_cast<int64_t>(v_pools.size()) == L,
                "DecodeStack.forward: one K and one V pool per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat,
                "DecodeStack.forward: hidden must be float32 [tokens, hidden]");
    for (size_t a = 0; a < aux_layers.size(); ++a) {
      TORCH_CHECK(aux_layers[a] >= 0 && aux_layers[a] <= L &&
                      (a == 0 || aux_layers[a] > aux_layers[a - 1]),
                  "DecodeStack.forward: aux_layers must ascend within 0 ..", L);
    }
    for (const auto& layer : layers) {
      for (const auto& parts : layer.projections) {
        TORCH_CHECK(!parts.empty(), "DecodeStack.forward: a layer is missing a projection");
      }
    }
    const int64_t tokens = hidden.size(0), q_width = num_heads * head_dim;
    std::vector<at::Tensor> out(2);
    size_t next_aux = 0;
    auto capture = [&](int64_t i, const at::Tensor& stream) {  // a copy: later ops write in place
      if (next_aux < aux_layers.size() && aux_layers[next_aux] == i) {
        out.push_back(stream.clone());
        ++next_aux;
      }
    };
    at::Tensor residual;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& layer = layers[i];
      if (i == 0) {
        capture(0, hidden);
        residual = hidden;
        hidden = o.rms_norm.call(hidden, layer.input_norm, eps);
      } else {
        o.add_rms_norm.call(hidden, residual, layer.input_norm, eps);
        capture(i, residual);  // residual += hidden: the sum the modules capture
      }
      at::Tensor qkv = project(layer.projections[kQkv], hidden);
      o.rope_store.call(qkv, cos, sin, k_pools[i], v_pools[i], slots, num_heads, num_kv_heads,
                        head_dim, layer.q_norm, layer.k_norm, eps);
      const at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
      const at::Tensor attn = attend(q.contiguous(), i);
      at::Tensor projected = project(layer.projections[kO], attn.view({tokens, q_width}));
      o.add_rms_norm.call(projected, residual, layer.post_norm, eps);
      const at::Tensor act = o.silu_mul.call(project(layer.projections[kGateUp], projected));
      hidden = project(layer.projections[kDown], act);
    }
    if (next_aux < aux_layers.size()) out.push_back(hidden + residual);  // after the last
    out[0] = hidden;
    out[1] = residual;
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_part", &DecodeStack::add_part)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward)
      .def("forward_extend", &DecodeStack::forward_extend);
}
