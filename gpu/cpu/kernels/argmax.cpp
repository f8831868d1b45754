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
#ifdef LANES_VECTORS
  // Per lane: the largest value and where it first came (only a strictly larger value
  // moves it), then the lowest index among the lanes that hold the row's largest.
  using lanes::kLanes, lanes::Vec;
  Vec mx = lanes::splat(m);
  lanes::Ints at = lanes::splat_int(0), iv = lanes::lane_ids();
  const lanes::Ints step = lanes::splat_int(kLanes);
  lanes::Mask unordered = lanes::is_nan(mx);  // none: mx is -inf
  for (; v + kLanes <= V; v += kLanes, iv = lanes::add(iv, step)) {
    const Vec y = lanes::load(x + v);
    unordered = lanes::either(unordered, lanes::is_nan(y));
    const lanes::Mask larger = lanes::greater(y, mx);
    mx = lanes::select(larger, y, mx);
    at = lanes::select(larger, iv, at);
  }
  if (v > 0) {
    float lane_max[kLanes];
    int32_t lane_at[kLanes];
    lanes::store(lane_max, mx);
    lanes::store_ints(lane_at, at);
    m = lanes::max_lanes(mx);
    best = v;
    for (int64_t l = 0; l < kLanes; ++l) {
      if (lane_max[l] == m) best = std::min<int64_t>(best, lane_at[l]);
    }
    nan = lanes::any(unordered);
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
