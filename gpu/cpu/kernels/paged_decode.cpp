// Paged decode attention on CPU, reading the head-major KV pool in place.
//
// Why: the torch path gathers every decode row's K/V blocks into a fresh
// [kv_heads, B, L, D] tensor each layer before its two batched matmuls. That copy
// writes as many bytes as it reads and grows with context; at ~900 tokens it is
// most of a decode step. Here each (sequence, KV head) walks its block table and
// reads each key and value once, straight from the pool.
//
// Algorithm, per (sequence, KV head), run in parallel with at::parallel_for:
//   1. the group's query heads (GQA: num_heads / num_kv_heads of them), scaled, in fp32;
//   2. pass one: scores q·k for every visible key (keys > pos - window when a window
//      is set), kept in a per-task buffer (G * context floats, stays in L2);
//   3. softmax in place: max, exp (a vectorisable polynomial), sum;
//   4. pass two: accumulate p·v over the same keys, divide by the sum, write out.
// Each pass prefetches the next block's rows while it works on one (see for_each_run).
// Two passes instead of an online softmax: K and V live in separate pools anyway, so
// each is streamed once either way, and the exp runs over whole rows the compiler
// vectorises. Everything accumulates in fp32; bf16 is widened on load. A bf16 q over bf16
// pools on a host with AVX-512 BF16 takes paged_decode_bf16.h's two passes instead (the
// products on vdpbf16ps, the reads ahead spread over the work).
//
// Layout: k_cache/v_cache [num_kv_heads, num_slots, head_dim], slot = block *
// block_size + offset; q [B, num_heads, head_dim] (any row/head stride, dim
// contiguous); block_tables [B, max_blocks] and context_lens [B], int32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "entry_points.h"
#include "fast_exp.h"
#include "paged.h"
#include "paged_decode_bf16.h"
#include "reduce.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace paged;

// Softmax numerators in place over each of `rows` rows of `len` scores; returns sums.
void softmax_rows(float* scores, int64_t rows, int64_t len, float* sums) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
    float m = s[0], sum = 0.f;
    int64_t t = 0;
#ifdef LANES_VECTORS
    using lanes::kLanes, lanes::load, lanes::Vec;
    const int64_t whole = len - len % kLanes;
    if (whole > 0) {
      Vec mv = load(s);
      for (t = kLanes; t < whole; t += kLanes) mv = lanes::max(mv, load(s + t));
      m = lanes::max_lanes(mv);
    }
    for (t = whole; t < len; ++t) m = std::max(m, s[t]);
    const Vec mb = lanes::splat(m);
    Vec sv = lanes::zero();
    for (t = 0; t < whole; t += kLanes) {
      const Vec e = exp_nonpositive(lanes::sub(load(s + t), mb));
      lanes::store(s + t, e);
      sv = lanes::add(sv, e);
    }
    sum = lanes::sum_lanes(sv);
#else
    for (t = 1; t < len; ++t) m = std::max(m, s[t]);
    t = 0;
#endif
    for (; t < len; ++t) {
      s[t] = exp_nonpositive(s[t] - m);
      sum += s[t];
    }
    sums[g] = sum;
  }
}

template <typename T>
void scores_pass(const float* q, const T* k, const int32_t* table, int64_t first, int64_t n,
                 int64_t block_size, int64_t G, int64_t D, float* scores, int64_t len) {
  for_each_run(k, D, table, first, n, block_size, [&](int64_t slot, int64_t at, int64_t count) {
    const T* rows = k + slot * D;
#ifdef LANES_VECTORS
    using lanes::fmadd, lanes::kLanes, lanes::load, lanes::Vec;
    if (D % kLanes == 0) {
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float* out = scores + g * len + at;
        int64_t t = 0;
        for (; t + 4 <= count; t += 4) {  // four keys per q load
          Vec a0 = lanes::zero(), a1 = a0, a2 = a0, a3 = a0;
          const T* r = rows + t * D;
          for (int64_t d = 0; d < D; d += kLanes) {
            const Vec qv = load(qg + d);
            a0 = fmadd(qv, load(r + d), a0);
            a1 = fmadd(qv, load(r + D + d), a1);
            a2 = fmadd(qv, load(r + 2 * D + d), a2);
            a3 = fmadd(qv, load(r + 3 * D + d), a3);
          }
          _mm_storeu_ps(out + t, reduce4(a0, a1, a2, a3));
        }
        for (; t < count; ++t) {
          Vec a = lanes::zero();
          for (int64_t d = 0; d < D; d += kLanes)
            a = fmadd(load(qg + d), load(rows + t * D + d), a);
          out[t] = lanes::sum_lanes(a);
        }
      }
      return;
    }
#endif
    for (int64_t t = 0; t < count; ++t) {
      const T* r = rows + t * D;
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * to_float(r[d]);
        scores[g * len + at + t] = s;
      }
    }
  });
}

// T: q and the output; KV: the pools (float32 pools for float32 q, or bfloat16 pools for
// either: `--kv-cache-dtype bfloat16` keeps a float32 model's cache in half the bytes).
template <typename T, typename KV>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
            double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t G = H / KVH;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t table_row = block_tables.stride(0);
  const T* q_ptr = q.const_data_ptr<T>();
  const KV* k_ptr = k_cache.const_data_ptr<KV>();
  const KV* v_ptr = v_cache.const_data_ptr<KV>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  T* out_ptr = out.mutable_data_ptr<T>();

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), sums(G), scores;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / KVH, h = unit % KVH;
      const int64_t n = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t len = n - first;
      T* o = out_ptr + b * H * D + h * G * D;
      if (len <= 0) {  // no context (never scheduled, but keep the row defined)
        std::fill(o, o + G * D, T(0.f));
        continue;
      }
      scores.resize(G * len);
      const int32_t* table = tables + b * table_row;
      const KV* k_head = k_ptr + h * num_slots * D;
      const KV* v_head = v_ptr + h * num_slots * D;
      const T* q_group = q_ptr + b * q_row + h * G * q_head;
#ifdef PAGED_DECODE_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>) {
        if (D % 32 == 0) {  // paged_decode_bf16.h
          paged_bf16::scores_pass(q_group, q_head, k_head, v_head, table, first, n, block_size,
                                  G, D, static_cast<float>(scale), scores.data(), len);
          softmax_rows(scores.data(), G, len, sums.data());
          paged_bf16::Keys next;
          if (unit + 1 < end) {
            const int64_t nb = (unit + 1) / KVH, nh = (unit + 1) % KVH;
            next = {k_ptr + nh * num_slots * D, tables + nb * table_row,
                    window > 0 ? std::max<int64_t>(0, lens[nb] - window) : 0, lens[nb]};
          }
          paged_bf16::values_pass(scores.data(), v_head, table, first, n, block_size, G, D,
                                  acc.data(), len, next);
          paged_bf16::finish(acc.data(), sums.data(), G, D, o);
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q_group + g * q_head;
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(src[d]) * static_cast<float>(scale);
      }
      scores_pass(qf.data(), k_head, table, first, n, block_size, G, D, scores.data(), len);
      // The first value run arrives while the softmax runs (for_each_run fetches the rest).
      const int64_t first_slot = static_cast<int64_t>(table[first / block_size]) * block_size;
      prefetch_rows(v_head + (first_slot + first % block_size) * D,
                    std::min(block_size - first % block_size, len), D);
      softmax_rows(scores.data(), G, len, sums.data());
      values_pass(scores.data(), v_head, table, first, n, block_size, G, D, acc.data(), len, 1);
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = T(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

namespace kernels {

void paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t block_size, double scale, int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k/v pools must be contiguous [kv_heads, slots, head_dim] of one shape");
  TORCH_CHECK(k_cache.size(2) == q.size(2), "head_dim of q and the pool differ");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "the pools must share q's dtype, or be bfloat16 for float32 q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == q.size(0) && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "one block-table row and one context length per query row");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type(),
              "out must be contiguous [B, H, D] of q's dtype");
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat) {
    decode<float, float>(q, k_cache, v_cache, block_tables, context_lens, block_size, scale,
                         window, out);
  } else if (q.scalar_type() == at::kFloat) {
    decode<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                 scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens,
                                         block_size, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_decode takes float32 or bfloat16, got ", q.scalar_type());
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t block_size, double scale,
                        int64_t window) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  paged_decode_out(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window,
                   out);
  return out;
}

}  // namespace kernels

// float32 lanes of the vector paths this library was built with: 16 (AVX-512), 8 (AVX2 with
// FMA) or 1 (portable loops only). Callers pick thresholds by it, and skip kernels whose
// portable loops lose to torch's own (gpu/cpu/linear.py).
int64_t vector_width() {
#if defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__) && defined(__FMA__)
  return 8;
#else
  return 1;
#endif
}

TORCH_LIBRARY(ridgeline_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int window) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(kernels::paged_decode));
  m.def("vector_width() -> int", &vector_width);
}
