// Sampling rows of logits on CPU: temperature, top-k, top-p, min-p and the draw, per row
// in a few passes over its vocabulary, instead of a dozen torch ops over the batch.
//
// Why: in torch a sampled row costs a softmax, a float64 cumulative sum and, for top-k
// or top-p, a `topk` or a full sort of the vocabulary, a sizeable share of a decode
// step at a few dozen rows of a 49k vocabulary. Here a
// row is one max, one exp pass (the weights kept in a scratch row) and one sum; top-k
// collects the tokens above a floor (lowered until there are k) and selects among
// those; top-p bisects the weights' values over a shrinking set of open tokens. None
// sorts more than a few dozen tokens.
//
// Semantics are gpu/sampler.py's torch path (the reference; tests compare the two):
// weights w = exp((logit - max) / T), so the most likely token weighs 1 and a banned
// one (-inf) 0; top-k keeps the k heaviest; top-p then keeps the heaviest while the
// weight before each is at most p of what top-k kept (vLLM's order); min-p drops
// weights below min_p (relative to the heaviest, which is 1); the draw is the first
// token whose running sum of kept weights passes u times their total, u = bits / 2^53
// (inverse transform sampling). Where a cut falls between equal weights, the lowest
// ids are kept.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // weights per partial sum of the draw's walk
constexpr int64_t kAllTies = std::numeric_limits<int64_t>::max();

// The kept tokens: weight above tau, and the first `ties` (by id) of weight exactly tau.
struct Cut {
  float tau = 0.f;
  int64_t ties = kAllTies;
};

using Candidate = std::pair<float, int32_t>;  // (weight, token id)

// Heaviest first; equal weights by id, so a cut through ties keeps the lowest ids.
inline bool heavier(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Below this (relative to the heaviest) a weight is 0: exp(-87) ~ 1.6e-38 could never be
// drawn, and a banned token (-inf) must weigh exactly nothing.
constexpr float kLowest = -87.0f;

// w[v] = exp((logits[v] - max) / T), or 0 below kLowest.
void weigh(const float* logits, int64_t V, float temperature, float* w) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
#ifdef LANES_VECTORS
  // By hand: GCC kept the max a scalar chain (three quarters of the kernel's time).
  using lanes::kLanes, lanes::Vec;
  Vec mx = lanes::splat(m);
  for (; v + kLanes <= V; v += kLanes) mx = lanes::max(mx, lanes::load(logits + v));
  m = lanes::max_lanes(mx);
#endif
  for (; v < V; ++v) m = std::max(m, logits[v]);
  const float inv = 1.0f / temperature;
  v = 0;
#ifdef LANES_VECTORS
  const Vec mv = lanes::splat(m), iv = lanes::splat(inv), lowest = lanes::splat(kLowest);
  for (; v + kLanes <= V; v += kLanes) {
    const Vec x = lanes::mul(lanes::sub(lanes::load(logits + v), mv), iv);
    lanes::store(w + v, lanes::zero_unless(lanes::at_least(x, lowest), exp_nonpositive(x)));
  }
#endif
  for (; v < V; ++v) {
    const float x = (logits[v] - m) * inv;
    w[v] = x >= kLowest ? exp_nonpositive(x) : 0.f;
  }
}

// Sum of w, in float per block of kBlock (vectorised), the blocks in double; each
// block's sum into `sums` when given.
double sum_weights(const float* w, int64_t V, std::vector<double>* sums) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  if (sums != nullptr) sums->assign(blocks, 0.0);
  double all = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(V, (b + 1) * kBlock);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t v = b * kBlock; v < end; ++v) s += w[v];
    if (sums != nullptr) (*sums)[b] = s;
    all += s;
  }
  return all;
}

// Every token of weight >= least into (vals, ids), in id order; returns how many.
int64_t collect(const float* w, int64_t V, float least, float* vals, int32_t* ids) {
  int64_t n = 0, v = 0;
#ifdef LANES_VECTORS
  using lanes::kLanes;
  const lanes::Vec lv = lanes::splat(least);
  const lanes::Ints step = lanes::splat_int(kLanes);
  lanes::Ints iv = lanes::lane_ids();
  for (; v + kLanes <= V; v += kLanes, iv = lanes::add(iv, step)) {
    const lanes::Vec x = lanes::load(w + v);
    const lanes::Mask in = lanes::at_least(x, lv);
    if (!lanes::any(in)) continue;  // most blocks of a row: nothing this heavy
    n += lanes::compress(in, x, iv, vals + n, ids + n);  // n <= v: stays inside the row
  }
#endif
  for (; v < V; ++v) {
    if (w[v] >= least) vals[n] = w[v], ids[n++] = static_cast<int32_t>(v);
  }
  return n;
}

// The weights >= a floor, lowered from 1/64 by 16x until `enough(n)` (or every positive
// weight is in); returns (how many, the floor used, 0 for every positive weight).
template <typename Enough>
std::pair<int64_t, float> collect_down(const float* w, int64_t V, float* vals, int32_t* ids,
                                       Enough enough) {
  for (float floor = 1.0f / 64;; floor /= 16) {
    const bool last = floor < 1e-30f;
    const int64_t n = collect(w, V, last ? std::numeric_limits<float>::denorm_min() : floor,
                              vals, ids);
    if (last || enough(n)) return {n, last ? 0.f : floor};
  }
}

// The cut that keeps the n heaviest of `c` (1 <= n <= c.size()), given their weights
// are all >= c[n - 1]'s: as many of its equals as the n hold.
Cut cut_at(const std::vector<Candidate>& c, size_t n) {
  const float tau = c[n - 1].first;
  int64_t above = 0, equal = 0;
  for (const auto& x : c) {
    above += x.first > tau;
    equal += x.first == tau;
  }
  const int64_t ties = static_cast<int64_t>(n) - above;
  return {tau, ties >= equal ? kAllTies : ties};
}

// Top-k: the cut that keeps the k heaviest.
Cut top_k_cut(const float* w, int64_t V, int64_t k, float* vals, int32_t* ids) {
  const auto [n, floor] = collect_down(w, V, vals, ids, [&](int64_t n) { return n >= k; });
  if (n < k || (n == k && floor == 0.f)) return {};  // k or fewer weigh anything: no cut
  std::vector<Candidate> c(n);
  for (int64_t j = 0; j < n; ++j) c[j] = {vals[j], ids[j]};
  std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), heavier);
  return cut_at(c, k);
}

// A non-negative float's bits, read as an integer, order like the float.
inline int32_t key(float w) {
  int32_t k;
  std::memcpy(&k, &w, sizeof k);
  return k;
}

// Weight of the first n of `vals` whose key is above t.
double mass_above(const float* vals, int64_t n, int32_t t) {
  double all = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = b; j < end; ++j) s += key(vals[j]) > t ? vals[j] : 0.f;
    all += s;
  }
  return all;
}

// Keep, in place, those of the first n of (vals, ids) whose key is above t (`above`)
// or at most t (not `above`); returns how many.
int64_t keep_side(float* vals, int32_t* ids, int64_t n, int32_t t, bool above) {
  int64_t kept = 0, j = 0;
#ifdef LANES_VECTORS
  using lanes::kLanes;
  const lanes::Ints tv = lanes::splat_int(t);
  int32_t* keys = reinterpret_cast<int32_t*>(vals);  // key(vals[j]), as stored
  for (; j + kLanes <= n; j += kLanes) {  // each store lands at or before what was just loaded
    const lanes::Ints k = lanes::load_ints(keys + j);
    const lanes::Mask gt = lanes::greater(k, tv);
    kept += lanes::compress(above ? gt : lanes::invert(gt), k, lanes::load_ints(ids + j),
                            keys + kept, ids + kept);
  }
#endif
  for (; j < n; ++j) {
    if ((key(vals[j]) > t) == above) vals[kept] = vals[j], ids[kept++] = ids[j];
  }
  return kept;
}

// Top-p: keep the heaviest tokens while the weight before each is at most `limit`.
// Rather than sort, bisect the weights' keys for the least key whose heavier tokens
// weigh at most `limit`. Each halving keeps only the tokens whose fate is still open
// (keys in (lo, hi]), so the passes shrink; the last few are sorted and walked.
Cut top_p_cut(const float* w, int64_t V, double limit, float* vals, int32_t* ids) {
  // Open at first: the weights above a floor under which more than `limit` lies above
  // (the tokens under it are dropped).
  const auto [first, floor] = collect_down(w, V, vals, ids, [&](int64_t n) {
    return mass_above(vals, n, -1) > limit;
  });
  int64_t n = first;
  int32_t lo = floor > 0.f ? key(floor) - 1 : 0, hi = key(1.0f);
  double kept_mass = 0.0;  // of the tokens above hi: all kept
  while (n > 32 && hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    const double upper = mass_above(vals, n, mid);
    const bool fits = kept_mass + upper <= limit;  // then every token above mid is kept
    if (fits) {
      kept_mass += upper;
      hi = mid;
    } else {
      lo = mid;
    }
    n = keep_side(vals, ids, n, mid, /*above=*/!fits);
  }
  std::vector<Candidate> open(n);
  for (int64_t j = 0; j < n; ++j) open[j] = {vals[j], ids[j]};
  std::sort(open.begin(), open.end(), heavier);
  size_t kept = 0;
  for (double before = kept_mass; kept < open.size() && before <= limit; ++kept) {
    before += open[kept].first;
  }
  if (kept > 0) return cut_at(open, kept);
  float above_hi;  // none open (only rounding could do it): keep what lies above hi
  std::memcpy(&above_hi, &hi, sizeof above_hi);
  return {above_hi, 0};
}

// Zero what the cut drops, in place.
void apply(float* w, int64_t V, const Cut& cut) {
  for (int64_t v = 0; v < V; ++v) {
    if (w[v] < cut.tau) w[v] = 0.f;
  }
  if (cut.ties == kAllTies) return;
  int64_t kept = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (w[v] == cut.tau && kept++ >= cut.ties) w[v] = 0.f;
  }
}

// Top-k, then top-p over what top-k kept, then min-p: what they drop is zeroed.
void cut_row(float* w, int64_t V, int64_t top_k, float top_p, float min_p, float* vals,
             int32_t* ids) {
  Cut cut;
  if (top_k > 0 && top_k < V) cut = top_k_cut(w, V, top_k, vals, ids);
  if (top_p < 1.0f) {
    if (cut.tau > 0.f) apply(w, V, cut);
    cut = top_p_cut(w, V, top_p * sum_weights(w, V, nullptr), vals, ids);
  }
  if (min_p > 0.f && min_p >= cut.tau) {  // the heaviest weighs 1: min_p is the floor
    cut = {min_p, min_p > cut.tau ? kAllTies : cut.ties};
  }
  if (cut.tau > 0.f) apply(w, V, cut);
}

// The first token whose running sum of weights passes u * (their total).
int64_t draw(const float* w, int64_t V, uint64_t bits, std::vector<double>& sums) {
  const double all = sum_weights(w, V, &sums);
  const int64_t blocks = static_cast<int64_t>(sums.size());
  const double target = static_cast<double>(bits) * 0x1p-53 * all;
  double before = 0.0;
  int64_t b = 0;
  while (b + 1 < blocks && before + sums[b] <= target) before += sums[b++];
  int64_t last = -1;
  for (int64_t v = b * kBlock; v < V; ++v) {  // past the block only if rounding says so
    if (w[v] <= 0.f) continue;
    before += w[v];
    last = v;
    if (before > target) return v;
  }
  for (int64_t v = b * kBlock - 1; last < 0 && v >= 0; --v) {
    if (w[v] > 0.f) last = v;
  }
  return std::max<int64_t>(last, 0);  // 0: a row with no weight at all (all -inf)
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "sample_rows: logits must be [rows, vocab] float32 with unit column stride");
  const int64_t R = logits.size(0), V = logits.size(1);
  for (const auto* t : {&temperature, &top_k, &top_p, &min_p, &bits}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->is_contiguous(),
                "sample_rows: per-row values must be [rows] and contiguous");
  }
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong &&
                  bits.scalar_type() == at::kLong,
              "sample_rows: float32 temperature, top_p, min_p; int64 top_k, bits");
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lg = logits.data_ptr<float>();
  const float *temp = temperature.data_ptr<float>(), *tp = top_p.data_ptr<float>(),
              *mp = min_p.data_ptr<float>();
  const int64_t *tk = top_k.data_ptr<int64_t>(), *bt = bits.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  // One row after another on the calling thread: a row is tens of microseconds, and on
  // a shared host a parallel region can wait a time slice for a descheduled thread.
  // Scratch rows, written before they are read: not zero-filled (3 x 196 KB a call).
  std::unique_ptr<float[]> w(new float[V]), vals(new float[V]);
  std::unique_ptr<int32_t[]> ids(new int32_t[V]);
  std::vector<double> sums;
  for (int64_t r = 0; r < R; ++r) {
    weigh(lg + r * logits.stride(0), V, temp[r], w.get());
    cut_row(w.get(), V, tk[r], tp[r], mp[r], vals.get(), ids.get());
    o[r] = draw(w.get(), V, static_cast<uint64_t>(bt[r]), sums);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor bits) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
