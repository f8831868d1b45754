// The checks both paged prefill kernels (paged_prefill.cpp, paged_prefill_bf16.cpp) make
// of their arguments: one interface, so one set of messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace paged {

inline void check_prefill_args(const at::Tensor& out, const at::Tensor& q,
                               const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& query_starts,
                               const at::Tensor& query_lens, const at::Tensor& context_lens,
                               int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() &&
                  out.stride(2) == 1,
              "q and out must be [T, H, D] with contiguous D");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k/v pools must be contiguous [kv_heads, slots, head_dim] of one shape");
  TORCH_CHECK(k_cache.size(2) == q.size(2), "head_dim of q and the pool differ");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "q, out and the pools must share a dtype, or the pools be bfloat16 for float32 q");
  for (const at::Tensor* t : {&query_starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() &&
                    t->numel() == query_starts.numel(),
                "query_starts, query_lens and context_lens: one int32 per sequence");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == query_starts.numel(),
              "block_tables: one int32 row per sequence");
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  const int32_t* qlens = query_lens.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < query_starts.numel(); ++b)
    TORCH_CHECK(qlens[b] >= 1 && qlens[b] <= lens[b] && starts[b] >= 0 &&
                    starts[b] + qlens[b] <= q.size(0) &&
                    (lens[b] + block_size - 1) / block_size <= block_tables.size(1),
                "sequence ", b, ": its new tokens, context or block table are out of range");
}

}  // namespace paged
