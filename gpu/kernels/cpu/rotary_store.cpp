// RoPE on q and k fused with the KV store, for the CPU path (head-major pool).
//
// Why: in eager torch this is ~8 ops per layer (two products, rotate-half's slices,
// negation and concatenation, a sum, two index_copy_ with their transposes), each a
// dispatch and a pass over q/k. Here one pass per token: q is rotated in place
// (it is a view of the layer's fresh qkv projection, used by nothing else), k is
// rotated on its way into the pool, v copied beside it.
//
// Rotate-half layout, as HF checkpoints: for i < rot/2, (x[i], x[i + rot/2]) turns by
// the position's angle; dims past `rot` (partial rotary) pass through. Math in fp32,
// rounded once to the tensor's dtype.
//
// Shapes: q [T, H, D], k and v [T, KVH, D] (dims contiguous, any row/head stride),
// cos/sin [T, 1, rot] contiguous, k_cache/v_cache [KVH, slots, D], slot_mapping [T]
// int64 (-1: padding, skipped; the CPU path never pads, but the contract allows it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

namespace {

template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t rot, int64_t D, T* out) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float r1 = x1 * static_cast<float>(cos[i]) - x2 * static_cast<float>(sin[i]);
    const float r2 =
        x2 * static_cast<float>(cos[i + half]) + x1 * static_cast<float>(sin[i + half]);
    out[i] = T(r1);
    out[i + half] = T(r2);
  }
  if (out != x)
    for (int64_t i = rot; i < D; ++i) out[i] = x[i];
}

template <typename T>
void run(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
         const at::Tensor& slot_mapping) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t rot = cos.size(-1), num_slots = k_cache.size(1);
  T* qp = q.mutable_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  T* kc = k_cache.mutable_data_ptr<T>();
  T* vc = v_cache.mutable_data_ptr<T>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  // Small per-token work: one task per ~16 tokens keeps threads' start-up worth it.
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * rot;
      const T* s = sp + t * rot;
      for (int64_t h = 0; h < H; ++h) {
        T* x = qp + t * qs0 + h * qs1;
        rotate(x, c, s, rot, D, x);
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        rotate(kp + t * ks0 + h * ks1, c, s, rot, D, kc + (h * num_slots + slot) * D);
        const T* src = vp + t * vs0 + h * vs1;
        T* dst = vc + (h * num_slots + slot) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = src[i];
      }
    }
  });
}

void rotary_store(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "q, k, v must be [T, heads, D] with contiguous D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == q.size(0) &&
                  cos.numel() == sin.numel() && cos.size(-1) % 2 == 0 &&
                  cos.size(-1) <= q.size(2),
              "cos/sin must be contiguous [T, 1, rot], rot even and <= head_dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.size(0) == k.size(1) && k_cache.size(2) == q.size(2),
              "pools must be contiguous [kv_heads, slots, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0),
              "slot_mapping must be int64, one per token");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "every tensor must share q's dtype");
  if (dtype == at::kFloat) {
    run<float>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  } else if (dtype == at::kBFloat16) {
    run<c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  } else {
    TORCH_CHECK(false, "rotary_store takes float32 or bfloat16, got ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("rotary_store(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("rotary_store", c10::DispatchKey::CPU, TORCH_FN(rotary_store));
}
