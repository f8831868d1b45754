// The sampler's adjustments that bind every row, on CPU, in place: the penalties, and a
// structured output's token bitmask. One pass over each row that needs them.
//
// Penalties. In torch they are a dozen ops over the [rows, vocab] slice (gathers of the
// rows' counts and prompt marks, two nested `where`s, the products and the sums, the
// scatter back), each a pass over the whole slice, for a handful of tokens per row
// that were seen. Semantics and rounding are gpu/penalties.py's `penalize` (the
// reference): a token seen in the output or marked in the prompt is divided by the
// repetition penalty when positive and multiplied when not; then presence times "seen
// in the output" plus frequency times its count is subtracted, the same operations in
// the same order.
//
// Bitmask (xgrammar's layout: bit j of word i is token 32 i + j, 1 = allowed): a token
// not allowed becomes -inf, as gpu/sampler.py's `shape_logits` does in torch (unpacking
// every bit to a bool first) and xgrammar's own CPU kernel do in more passes.
// Here 16 logits take one masked store.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

void apply_penalties_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& counts,
                      const at::Tensor& in_prompt, const at::Tensor& slots,
                      const at::Tensor& repetition, const at::Tensor& presence,
                      const at::Tensor& frequency) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_penalties_: logits must be [rows, vocab] float32, unit column stride");
  TORCH_CHECK(counts.scalar_type() == at::kFloat && counts.is_contiguous() &&
                  in_prompt.scalar_type() == at::kBool && in_prompt.is_contiguous() &&
                  counts.size(1) == logits.size(1) && in_prompt.sizes() == counts.sizes(),
              "apply_penalties_: counts [slots, vocab] float32 and in_prompt bool, contiguous");
  const int64_t n = rows.size(0), V = logits.size(1);
  for (const auto* t : {&rows, &slots, &repetition, &presence, &frequency}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->is_contiguous(),
                "apply_penalties_: per-row values must be [rows] and contiguous");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  repetition.scalar_type() == at::kFloat &&
                  presence.scalar_type() == at::kFloat && frequency.scalar_type() == at::kFloat,
              "apply_penalties_: int64 rows and slots, float32 penalties");
  const int64_t *row = rows.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  const float *rep = repetition.data_ptr<float>(), *pres = presence.data_ptr<float>(),
              *freq = frequency.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= row[i] && row[i] < logits.size(0) && 0 <= slot[i] &&
                    slot[i] < counts.size(0),
                "apply_penalties_: row or slot out of range");
    float* x = logits.data_ptr<float>() + row[i] * logits.stride(0);
    const float* c = counts.data_ptr<float>() + slot[i] * V;
    const bool* p = in_prompt.data_ptr<bool>() + slot[i] * V;
    const float r = rep[i], pr = pres[i], fr = freq[i];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      const bool seen = c[v] > 0.f;
      const float y = (seen || p[v]) ? (x[v] > 0.f ? x[v] / r : x[v] * r) : x[v];
      x[v] = y - (pr * static_cast<float>(seen) + fr * c[v]);
    }
  }
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& rows,
                          const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be [rows, vocab] float32, unit column stride");
  const int64_t n = rows.size(0), V = logits.size(1), words = (V + 31) / 32;
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.is_contiguous() && bitmask.size(0) == n && bitmask.size(1) >= words,
              "apply_token_bitmask_: int64 rows [n], int32 bitmask [n, ceil(vocab / 32)]");
  const int64_t* row = rows.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= row[i] && row[i] < logits.size(0), "apply_token_bitmask_: bad row");
    float* x = logits.data_ptr<float>() + row[i] * logits.stride(0);
    const uint32_t* bits =
        reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + i * bitmask.size(1);
    int64_t v = 0;
#ifdef __AVX512F__
    const __m512 ninf = _mm512_set1_ps(neg_inf);
    for (; v + 32 <= V; v += 32) {
      const uint32_t word = bits[v / 32];
      const __mmask16 lo = static_cast<__mmask16>(~word), hi = static_cast<__mmask16>(~word >> 16);
      _mm512_mask_storeu_ps(x + v, lo, ninf);
      _mm512_mask_storeu_ps(x + v + 16, hi, ninf);
    }
#endif
    for (; v < V; ++v) {
      if (!((bits[v / 32] >> (v % 32)) & 1u)) x[v] = neg_inf;
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("apply_penalties_(Tensor(a!) logits, Tensor rows, Tensor counts, Tensor in_prompt, "
        "Tensor slots, Tensor repetition, Tensor presence, Tensor frequency) -> ()");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
  m.impl("apply_penalties_", c10::DispatchKey::CPU, TORCH_FN(apply_penalties_));
  m.impl("apply_token_bitmask_", c10::DispatchKey::CPU, TORCH_FN(apply_token_bitmask_));
}
