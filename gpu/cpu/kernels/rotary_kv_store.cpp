// RoPE on q and k, and the KV store, in one pass per token (CPU).
//
// Why: in plain torch RoPE is ~8 ops per layer (two muls, a negation and a cat for
// the rotated half, the add, and a cat to join q and k heads) and the store two
// index_copy_ calls; at decode batch sizes each is mostly dispatch. Here each
// token's q heads are rotated in place (q is a view into the fused qkv projection, as
// on CUDA: gpu/triton/rotary_kv_store.py), and its k heads rotated on their way into
// the pool beside its v heads.
//
// Rounding matches models/rope.py's `x * cos + rotate_half(x) * sin` op for op (two
// products and a sum, each rounded to the dtype), so float32 results are bit-identical
// to the torch path; the build's -ffp-contract=off keeps the compiler from fusing
// them. Partial rotary (cos/sin narrower than head_dim) rotates the first `rot` dims
// and passes the rest through.
//
// Layout: q [T, H, D], k and v [T, KVH, D] (any token/head strides, dims contiguous);
// cos, sin [T, rot] (or [T, 1, rot]); pools [KVH, slots, D]; slot_mapping [T] int64.
// The pools share q's dtype, or are bfloat16 under float32 q (`--kv-cache-dtype
// bfloat16`): k is rotated in float32 and each value then rounded to bfloat16 (to nearest
// even), as the torch path's store does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "entry_points.h"
#include "lanes.h"

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// n values into the pool: a copy, or each rounded to the pool's bfloat16.
template <typename T, typename KV>
inline void store(const T* src, KV* dst, int64_t n) {
  if constexpr (std::is_same_v<T, KV>) {
    std::memcpy(dst, src, sizeof(T) * n);
  } else {
    int64_t i = 0;
#ifdef LANES_VECTORS
    for (; i + lanes::kLanes <= n; i += lanes::kLanes) lanes::store(dst + i, lanes::load(src + i));
#endif
    for (; i < n; ++i) dst[i] = KV(widen(src[i]));
  }
}

// Asks for the lines of n values at p to come into the cache, to be written.
template <typename KV>
inline void prefetch_for_write(const KV* p, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(KV)); o += 64)
    _mm_prefetch(bytes + o, _MM_HINT_ET0);
#endif
}

// One head rotated from `src` into `dst` (they may be the same row: each pair is read
// before either half is written), computed in T and stored as KV. `cos` and `sin` are
// the token's tables, in T or already widened to float (C): the same values either way.
template <typename T, typename KV, typename C>
inline void rotate(const T* src, KV* dst, const C* cos, const C* sin, int64_t rot,
                   int64_t dim) {
  const int64_t half = rot / 2;
  int64_t i = 0;
  // The same products, sums and roundings on vector lanes (lanes.h), then the tail. The
  // sums are not rounded to T before the store: a bfloat16 T's store rounds them the
  // same way, and a float T leaves them as they are (then a bfloat16 pool rounds them).
#ifdef LANES_VECTORS
  using lanes::add, lanes::load, lanes::mul, lanes::rounded;
  for (; i + lanes::kLanes <= half; i += lanes::kLanes) {
    const lanes::Vec a = load(src + i), b = load(src + i + half);
    const lanes::Vec lo = add(rounded<T>(mul(a, load(cos + i))),
                              rounded<T>(mul(lanes::neg(b), load(sin + i))));
    const lanes::Vec hi = add(rounded<T>(mul(b, load(cos + i + half))),
                              rounded<T>(mul(a, load(sin + i + half))));
    lanes::store(dst + i, lo);
    lanes::store(dst + i + half, hi);
  }
#endif
  for (; i < half; ++i) {
    const float a = widen(src[i]), b = widen(src[i + half]);
    const T lo = T(widen(T(a * widen(cos[i]))) + widen(T(-b * widen(sin[i]))));
    const T hi = T(widen(T(b * widen(cos[i + half]))) + widen(T(a * widen(sin[i + half]))));
    dst[i] = KV(widen(lo));
    dst[i + half] = KV(widen(hi));
  }
  if (static_cast<const void*>(dst) != static_cast<const void*>(src))
    store(src + rot, dst + rot, dim - rot);
}

// Each token's heads in turn, rotated with the token's tables as `C`.
template <typename T, typename KV, typename C>
inline void token(T* q, int64_t q_head, const T* k, int64_t k_head, const T* v,
                  int64_t v_head, const C* c, const C* s, KV* kc, KV* vc, int64_t heads,
                  int64_t kv_heads, int64_t rot, int64_t dim, int64_t pool_head) {
  for (int64_t h = 0; h < heads; ++h) rotate(q + h * q_head, q + h * q_head, c, s, rot, dim);
  for (int64_t h = 0; h < kv_heads; ++h) {
    rotate(k + h * k_head, kc + h * pool_head, c, s, rot, dim);
    store(v + h * v_head, vc + h * pool_head, dim);
  }
}

// Widest rot whose tables a task widens to float once per token, for all its heads.
constexpr int64_t kMaxWidened = 512;

template <typename T, typename KV>
void run(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
         const at::Tensor& slots) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(1), rot = cos.size(-1), num_slots = k_cache.size(1);
  T* qp = q.mutable_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  KV* kc = k_cache.mutable_data_ptr<KV>();
  KV* vc = v_cache.mutable_data_ptr<KV>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  const int64_t q_tok = q.stride(0), q_head = q.stride(1), k_tok = k.stride(0),
                k_head = k.stride(1), v_tok = v.stride(0), v_head = v.stride(1);
  const int64_t pool_head = num_slots * dim;
  // ~8K elements a task (decoder_ops.cpp's grain): a decode batch of a few dozen tokens
  // splits over two threads, a handful of tokens stays on the calling thread.
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 13) / ((heads + kv_heads) * dim)),
                   [&](int64_t begin, int64_t end) {
    float wide[2][kMaxWidened];  // cos and sin widened, when T is bfloat16
    // The task's pool rows, asked for up front (for writing): each is in a page of its
    // own, cold since the step before, so one at a time each store would wait on its own
    // miss; asked together, the misses overlap while the rotation runs.
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        prefetch_for_write(kc + h * pool_head + slot[t] * dim, dim);
        prefetch_for_write(vc + h * pool_head + slot[t] * dim, dim);
      }
    }
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs;
      const T* s = sp + t * ss;
      T* qt = qp + t * q_tok;
      const T* kt = kp + t * k_tok;
      const T* vt = vp + t * v_tok;
      KV* kct = kc + slot[t] * dim;
      KV* vct = vc + slot[t] * dim;
      if (std::is_same_v<T, float> || rot > kMaxWidened) {
        token(qt, q_head, kt, k_head, vt, v_head, c, s, kct, vct, heads, kv_heads, rot, dim,
              pool_head);
      } else {
        for (int64_t i = 0; i < rot; ++i) {
          wide[0][i] = widen(c[i]);
          wide[1][i] = widen(s[i]);
        }
        token(qt, q_head, kt, k_head, vt, v_head, wide[0], wide[1], kct, vct, heads,
              kv_heads, rot, dim, pool_head);
      }
    }
  });
}

}  // namespace

namespace kernels {

void rotary_kv_store_(at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "q, k, v must be [T, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "k and v must be [T, kv_heads, head_dim] beside q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == k.size(1) &&
                  k_cache.size(2) == k.size(2),
              "pools must be contiguous [kv_heads, slots, head_dim]");
  const int64_t rot = cos.size(-1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                  cos.size(0) == q.size(0) && cos.numel() == q.size(0) * rot &&
                  rot % 2 == 0 && rot <= q.size(2),
              "cos/sin must be [T, rot] (or [T, 1, rot]) with an even rot <= head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0),
              "slot_mapping must be int64 [T]");
  const auto dtype = q.scalar_type();
  const auto pool = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  v_cache.scalar_type() == pool &&
                  (pool == dtype || (dtype == at::kFloat && pool == at::kBFloat16)),
              "q, k, v, cos and sin must share a dtype, and the pools it or bfloat16 under "
              "float32");
  if (dtype == at::kFloat && pool == at::kFloat) {
    run<float, float>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  } else if (dtype == at::kFloat) {
    run<float, c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  } else if (dtype == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  } else {
    TORCH_CHECK(false, "rotary_kv_store_ takes float32 or bfloat16, got ", dtype);
  }
}

}  // namespace kernels

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("rotary_kv_store_(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("rotary_kv_store_", c10::DispatchKey::CPU, TORCH_FN(kernels::rotary_kv_store_));
}
