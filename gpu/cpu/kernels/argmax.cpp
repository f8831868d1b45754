// Greedy decoding on CPU: the index of each row's largest logit, as torch.argmax gives it
// (the first of equal maxima; the first NaN if a row has one), float32 or bfloat16 rows.
//
// Why: a greedy batch's rows are independent and one row of a large vocabulary is
// microseconds of work; this reads a bf16 row in place, where torch would first widen
// every logit to float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "lanes.h"
#include "reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The first index of a row's largest value, or of its first NaN: torch.argmax's answer.
// bf16 rows (a bf16 model's logits) are widened as they are read: exact, so the answer is
// the widened row's, without the float32 copy of every logit it would take first.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t best = 0, v = 0;
  bool nan = false;
#ifdef __AVX512F__
  // Per lane: the largest value and where it first came (only a strictly larger value
  // moves it), then the lowest index among the lanes that hold the row's largest.
  __m512 mx = _mm512_set1_ps(m);
  __m512i at = _mm512_setzero_si512(), iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                               10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 unordered = 0;
  for (; v + 16 <= V; v += 16, iv = _mm512_add_epi32(iv, step)) {
    const __m512 y = lanes::load16(x + v);
    unordered |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_cmp_ps_mask(y, mx, _CMP_GT_OQ);
    mx = _mm512_mask_mov_ps(mx, larger, y);
    at = _mm512_mask_mov_epi32(at, larger, iv);
  }
  m = _mm512_reduce_max_ps(mx);
  const __mmask16 holders = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_EQ_OQ);
  best = v == 0 ? 0 : _mm512_mask_reduce_min_epi32(holders, at);
  nan = unordered != 0;
  if (v == 0) m = -std::numeric_limits<float>::infinity();
#elif defined(__AVX2__) && defined(__FMA__)
  // The same on 8 lanes, blends for masks; the lanes' answers compared in scalar code.
  __m256 mx = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  __m256i at = _mm256_setzero_si256(), iv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; v + 8 <= V; v += 8, iv = _mm256_add_epi32(iv, _mm256_set1_epi32(8))) {
    const __m256 y = lanes::load8(x + v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    const __m256 larger = _mm256_cmp_ps(y, mx, _CMP_GT_OQ);
    mx = _mm256_blendv_ps(mx, y, larger);
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(iv), larger));
  }
  if (v > 0) {
    alignas(32) float lane_max[8];
    alignas(32) int32_t lane_at[8];
    _mm256_store_ps(lane_max, mx);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), at);
    m = reduce_max8(mx);
    best = v;
    for (int l = 0; l < 8; ++l) {
      if (lane_max[l] == m) best = std::min<int64_t>(best, lane_at[l]);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; v < V; ++v) {
    const float y = static_cast<float>(x[v]);
    nan |= std::isnan(y);
    if (y > m) m = y, best = v;
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(static_cast<float>(x[j]))) return j;
    }
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be [rows, vocab > 0] float32 or bfloat16, unit column "
              "stride");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  // Rows in parallel: a batch's rows are independent, and one row of a 50k vocabulary
  // is microseconds of work, so only several rows are worth a thread's wake-up.
  auto rows = [&](const auto* x) {
    at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, V);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    rows(logits.const_data_ptr<float>());
  } else {
    rows(logits.const_data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
