// A decode step's decoder layers in one call (CPU, a bf16 model with Q4_1 blocks, or a
// K-quant mix of Q4_1 and Q8_16 blocks, one new token per sequence, every linear on its
// format's blocks route for the step's rows): the module path's kernels, called in its
// order, with no Python between them.
//
// Why: at one user a layer is nine kernel calls of a few microseconds each, and in the
// module path each sits behind nn.Module calls, the linear's routing, the attention
// backend's per-layer Python and the views and splits between them; over a step's
// layers that is a large share of the step. Here the same functions run back to back
// (entry_points.h), so the results are the module path's bit for bit.
//
// Per layer (the residual stream carried beside the hidden states, as models/decoder.py):
//   h = add_rms_norm_(out, residual)       (the first layer: rms_norm of the embeddings)
//   qkv = linear(h); q, k, v its heads     (views: q is rotated in place)
//   rotary_kv_store_(q, k, v, cos, sin, pools, slots); o = paged_decode(q, pools)
//   h = add_rms_norm_(linear(o), residual); out = linear(silu_and_mul(linear(h)))
// and after the last layer the final norm: add_rms_norm_(out, residual). A linear whose
// parts came in different formats (a Q4_K_M file's q and k beside a Q6_K v: the
// module path's SplitLinear) is its parts' kernels, their outputs side by side.
//
// Arguments: `weights`, a `DecodeWeights` bound once per model (gpu/cpu/layer_call.py:
// its few hundred tensors, not converted from Python lists at every step): each
// layer's input and post-attention norm weights, then the final norm's; per linear
// (layer by layer: qkv, o, gate_up, down) its parts' count, and per part its format and
// N; per route (the AVX512-BF16 dot-product kernel, the blocks' exact kernel, AMX, the
// int8 kernel: gpu/cpu/routing.py picks it by format and rows) each part's kArgs
// tensors as gpu/cpu/linear.py's PackedLinear binds them for that route's kernel (empty
// tensors where the part has none). Per step: x [T, hidden] the embeddings (becomes the residual
// stream, updated in place, as in the module path), each format's route, cos and sin,
// the pools and the attention metadata as paged_decode takes them; where the step's
// rows share a prefix of blocks (gpu/attention/shared_prefix.py), its pieces: those rows
// and the prefix's length, the other rows (if any) with their block tables and lengths.
// Each layer's attention then is TorchAttentionBackend._cascade's: the cascade kernel
// for the sharing rows, paged_decode for the others, gathered and scattered back.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "entry_points.h"

#ifdef KERNELS_Q4_1_LINEAR_BF16

namespace {

constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down
constexpr int64_t kArgs = 3;  // a part's tensors for a route's kernel (N apart)

// The linears' kernel by route, and the parts' formats: the codes gpu/cpu/layer_call.py
// passes (`ROUTES`, `FORMATS`).
enum Route : int64_t { kDot = 0, kBlocks = 1, kAmx = 2, kInt8 = 3, kRoutes = 4 };
enum Format : int64_t { kQ4_1 = 0, kQ8_16 = 1, kFormats = 2 };

// The one call into a part's kernel: `args` its tensors as PackedLinear binds them for
// `route` (its `_dot_args`, `_quantized_args` (blocks and int8) or `_amx_args`, less N).
at::Tensor linear(int64_t format, int64_t route, const at::Tensor& x, const at::Tensor* args,
                  int64_t n) {
  if (format == kQ4_1 && route == kDot)
    return kernels::q4_1_linear_bf16(x, args[0], args[1], args[2], n);
  if (format == kQ8_16 && route == kDot)
    return kernels::q8_16_linear_bf16(x, args[0], args[1], args[2], n);
  if (format == kQ4_1 && route == kBlocks)
    return kernels::q4_1_linear(x, args[0], args[1], args[2], n);
  if (format == kQ8_16 && route == kBlocks)
    return kernels::q8_16_linear(x, args[0], args[1], args[2], n);
#ifdef KERNELS_INT8_LINEAR
  if (format == kQ4_1 && route == kInt8)
    return kernels::q4_1_linear_int8(x, args[0], args[1], args[2], n);
  if (format == kQ8_16 && route == kInt8)
    return kernels::q8_16_linear_int8(x, args[0], args[1], args[2], n);
#endif
#ifdef KERNELS_Q4_1_LINEAR_AMX
  if (format == kQ4_1 && route == kAmx)
    return kernels::q4_1_linear_amx(x, args[0], args[1], args[2], n);
  if (format == kQ8_16 && route == kAmx)
    return kernels::q8_16_linear_amx(x, args[0], args[1], args[2], n);
#endif
  TORCH_CHECK(false, "decode_layers_bf16: no kernel for format ", format, " on route ", route,
              " in this build");
}

// A model's tensors the fused call reads every step.
struct DecodeWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> norms;
  double eps;
  std::vector<int64_t> parts;  // per linear, its parts' count
  std::vector<int64_t> formats;  // per part
  std::vector<int64_t> out_features;  // per part
  int64_t num_heads;
  std::vector<at::Tensor> linears[kRoutes];  // per route, kArgs tensors per part
  std::vector<int64_t> first;  // per linear, the index of its first part
  bool takes[kFormats][kRoutes] = {};  // every part of the format has the route's tensors
  bool has[kFormats] = {};  // some part has the format

  DecodeWeights(std::vector<at::Tensor> norms_, double eps_, std::vector<int64_t> parts_,
                std::vector<int64_t> formats_, std::vector<int64_t> out_features_,
                int64_t num_heads_, std::vector<at::Tensor> dot, std::vector<at::Tensor> blocks,
                std::vector<at::Tensor> amx, std::vector<at::Tensor> int8)
      : norms(std::move(norms_)), eps(eps_), parts(std::move(parts_)),
        formats(std::move(formats_)), out_features(std::move(out_features_)),
        num_heads(num_heads_),
        linears{std::move(dot), std::move(blocks), std::move(amx), std::move(int8)} {
    const auto layers = static_cast<int64_t>(parts.size()) / kLinears;
    const auto count = static_cast<int64_t>(formats.size());
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(parts.size()) == kLinears * layers &&
                    static_cast<int64_t>(norms.size()) == 2 * layers + 1,
                "DecodeWeights: per layer two norms and ", kLinears, " linears' part counts, "
                "then the final norm");
    TORCH_CHECK(static_cast<int64_t>(out_features.size()) == count,
                "DecodeWeights: a format and an N per part");
    for (const int64_t p : parts) {
      TORCH_CHECK(p > 0, "DecodeWeights: a linear of no parts");
      first.push_back(first.empty() ? 0 : first.back() + parts[first.size() - 1]);
    }
    TORCH_CHECK(first.back() + parts.back() == count, "DecodeWeights: ", count,
                " parts' formats for part counts adding up to ", first.back() + parts.back());
    for (const int64_t f : formats) {
      TORCH_CHECK(f >= 0 && f < kFormats, "DecodeWeights: no format ", f);
      has[f] = true;
    }
    for (int64_t r = 0; r < kRoutes; ++r) {
      TORCH_CHECK(static_cast<int64_t>(linears[r].size()) == kArgs * count, "DecodeWeights: ",
                  kArgs, " tensors per part for each route (empty where it has none)");
      for (int64_t f = 0; f < kFormats; ++f) takes[f][r] = has[f];
      for (int64_t p = 0; p < count; ++p)
        takes[formats[p]][r] &= linears[r][kArgs * p].numel() > 0;
    }
  }
};

// The rows of a step sharing a prefix of blocks (gpu/attention/shared_prefix.py's
// SharedPrefix): `rows` absent where none do (each row then takes paged_decode),
// `others` (and their tables and lengths) absent where every row does.
struct Shared {
  const std::optional<at::Tensor>& rows;
  int64_t tokens;
  const std::optional<at::Tensor>& others;
  const std::optional<at::Tensor>& other_tables;
  const std::optional<at::Tensor>& other_lens;
};

// A layer's decode attention into `out` [T, heads, D], as the attention backend's _decode
// takes it for a bf16 model without a sliding window.
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, const Shared& shared,
            int64_t block_size, double scale, at::Tensor& out) {
  if (!shared.rows.has_value()) {
    kernels::paged_decode_out(q, k_cache, v_cache, block_tables, context_lens, block_size,
                              scale, 0, out);
    return;
  }
#ifdef KERNELS_CASCADE_DECODE_AMX
  kernels::cascade_decode_amx_(out, q, k_cache, v_cache, block_tables, context_lens,
                               *shared.rows, shared.tokens, block_size, scale);
  if (shared.others.has_value()) {
    const at::Tensor& others = *shared.others;
    out.index_copy_(0, others,
                    kernels::paged_decode(at::index_select(q, 0, others), k_cache, v_cache,
                                          *shared.other_tables, *shared.other_lens,
                                          block_size, scale, 0));
  }
#else
  TORCH_CHECK(false, "decode_layers_bf16: a shared prefix, but no cascade kernel in this build");
#endif
}

at::Tensor decode_layers_bf16(const c10::intrusive_ptr<DecodeWeights>& w, at::Tensor& x,
                              at::IntArrayRef routes, const at::Tensor& cos,
                              const at::Tensor& sin,
                              at::TensorList k_caches, at::TensorList v_caches,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& context_lens,
                              const std::optional<at::Tensor>& shared_rows,
                              int64_t shared_tokens, const std::optional<at::Tensor>& others,
                              const std::optional<at::Tensor>& other_tables,
                              const std::optional<at::Tensor>& other_lens, int64_t block_size,
                              double scale) {
  const char* op = "decode_layers_bf16";
  const int64_t layers = static_cast<int64_t>(w->parts.size()) / kLinears;
  TORCH_CHECK(static_cast<int64_t>(routes.size()) == kFormats, op, ": a route per format");
  for (int64_t f = 0; f < kFormats; ++f)
    TORCH_CHECK(!w->has[f] || (routes[f] >= 0 && routes[f] < kRoutes && w->takes[f][routes[f]]),
                op, ": no parts' arguments of format ", f, " for route ", routes[f]);
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers &&
                  static_cast<int64_t>(v_caches.size()) == layers,
              op, ": a K and a V pool per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, op,
              ": x must be contiguous bfloat16 [T, hidden]");
  const std::vector<at::Tensor>& norms = w->norms;
  const double eps = w->eps;
  const int64_t T = x.size(0), kv_heads = k_caches[0].size(0), D = k_caches[0].size(2);
  const int64_t heads = w->num_heads;
  const Shared shared{shared_rows, shared_tokens, others, other_tables, other_lens};
  TORCH_CHECK(others.has_value() == other_tables.has_value() &&
                  others.has_value() == other_lens.has_value() &&
                  (shared_rows.has_value() || !others.has_value()),
              op, ": the other rows come with their tables and lengths, beside a prefix's rows");
  // Linear i of the step (layer by layer: qkv, o, gate_up, down) on `in`: its parts'
  // kernels on their formats' routes, outputs side by side as SplitLinear's cat.
  const auto project = [&](int64_t i, const at::Tensor& in) {
    const auto part = [&](int64_t p) {
      const int64_t f = w->formats[p], r = routes[f];
      return linear(f, r, in, w->linears[r].data() + kArgs * p, w->out_features[p]);
    };
    const int64_t p0 = w->first[i];
    if (w->parts[i] == 1) return part(p0);
    std::vector<at::Tensor> outs;
    for (int64_t p = p0; p < p0 + w->parts[i]; ++p) outs.push_back(part(p));
    return at::cat(outs, 1);
  };
  at::Tensor& residual = x;
  // Each op's output in a buffer of the call, rewritten layer by layer (the linears'
  // kernel allocates its own); the final norm's is the result, a tensor of its own.
  at::Tensor h = at::empty_like(x), attn = at::empty({T, heads, D}, x.options()), act;
  kernels::rms_norm_out(x, norms[0], eps, h);
  at::Tensor out;  // the previous layer's output, not yet added to the residual stream
  for (int64_t l = 0; l < layers; ++l) {
    if (l > 0) kernels::add_rms_norm_out(out, residual, norms[2 * l], eps, h);
    // q, k and v: the heads of each row of qkv [T, (heads + 2 kv_heads) * D], as views.
    const at::Tensor qkv = project(kLinears * l, h);
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D, op, ": layer ", l, "'s qkv has ",
                qkv.size(1), " outputs, not (heads + 2 kv_heads) * head_dim");
    const int64_t row = qkv.stride(0), at = qkv.storage_offset();
    at::Tensor q = qkv.as_strided({T, heads, D}, {row, D, 1}, at);
    const at::Tensor k = qkv.as_strided({T, kv_heads, D}, {row, D, 1}, at + heads * D);
    const at::Tensor v =
        qkv.as_strided({T, kv_heads, D}, {row, D, 1}, at + (heads + kv_heads) * D);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    kernels::rotary_kv_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
    attend(q, k_cache, v_cache, block_tables, context_lens, shared, block_size, scale, attn);
    kernels::add_rms_norm_out(project(kLinears * l + 1, attn.view({T, heads * D})), residual,
                              norms[2 * l + 1], eps, h);
    const at::Tensor gate_up = project(kLinears * l + 2, h);
    if (!act.defined()) act = at::empty({T, gate_up.size(1) / 2}, x.options());
    kernels::silu_and_mul_out(gate_up, act);
    out = project(kLinears * l + 3, act);
  }
  return kernels::add_rms_norm_(out, residual, norms[2 * layers], eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.class_<DecodeWeights>("DecodeWeights")
      .def(torch::init<std::vector<at::Tensor>, double, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, int64_t,
                       std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>>());
  m.def("decode_layers_bf16(__torch__.torch.classes.ridgeline_cpu.DecodeWeights weights, "
        "Tensor(a!) x, int[] routes, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, Tensor? shared_rows, int shared_tokens, Tensor? others, "
        "Tensor? other_tables, Tensor? other_lens, int block_size, float scale) -> Tensor");
  m.impl("decode_layers_bf16", c10::DispatchKey::CPU, TORCH_FN(decode_layers_bf16));
}

#endif
