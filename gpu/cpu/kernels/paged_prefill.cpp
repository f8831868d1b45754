// Paged prefill attention on CPU: the new tokens of prefilling sequences attend to their
// context (a cached prefix, then themselves, causally), read from the head-major pool in
// place.
//
// Why: the torch path gathers each prefilling sequence's whole context into a fresh
// tensor per layer and calls SDPA with a boolean mask. After a cached prefix (a chat's
// system prompt, a shared document) the new tokens are few and the keys many, and that
// gather copies every cached key and value once per layer before SDPA reads them
// (benchmarks/cpu_decode_ab.py times both paths).
//
// Work unit: (sequence, tile of consecutive new tokens, KV head), run in parallel with
// at::parallel_for. Its rows are the tile's tokens x the G query heads of that KV head,
// token-major (row r: token r / G, head r % G), padded to whole 16-lane vectors: 16 G
// rows for a full tile of 16 tokens, fewer for a sequence's last few (2 tokens of
// SmolLM2's G = 3 take one vector, not three).
//   1. q, scaled, transposed to qt [D][R] in fp32;
//   2. scores transposed, s[key][row], for the tile's keys [first, n) (n: the last
//      token's position + 1): per key, all R rows at once as an outer product over d,
//      so no horizontal sums;
//   3. softmax down the keys, per lane over its token's own keys (causal, and inside
//      the sliding window when one is set): max, exp, sum under lane masks; keys a
//      token cannot see get probability 0;
//   4. p·v with the decode kernel's values pass (paged.h), keyed [key][row].
// A tile computes the scores its earlier tokens cannot see (up to the tile's length - 1
// keys): the price of vectors across tokens.
//
// Layout: q and out [T, num_heads, head_dim] (any row/head stride, dim contiguous);
// sequence s has query_lens[s] new tokens at rows query_starts[s].., and context_lens[s]
// tokens in the pool after this step, the new ones already stored (rotary_kv_store_).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "fast_exp.h"
#include "lanes.h"
#include "paged.h"
#include "prefill_args.h"

namespace {

using namespace paged;

// New tokens in a full tile. Larger tiles read each key for more rows, but compute more
// scores their earlier tokens cannot see; 16 balances the two for the head counts served.
constexpr int64_t TILE = 16;

#ifdef LANES_VECTORS
// Vectors of rows per tile: NK x kRowVectors accumulators and the row vectors of q fit
// the 32 registers of AVX-512 and the 16 of AVX2 (where R, a multiple of 16, is a whole
// number of 2-vector tiles).
constexpr int kRowVectors = lanes::kLanes == 16 ? 4 : 2;

// s[kk][v0 * kLanes .. (v0 + NV) * kLanes) = q·k for NK keys (rows of D) and NV vectors
// of rows.
template <int NK, int NV, typename T>
inline void score_tile(const float* qt, int64_t R, int64_t v0, const T* k, int64_t D,
                       float* s) {
  using lanes::Vec, lanes::kLanes;
  Vec acc[NK][NV];
  for (int kk = 0; kk < NK; ++kk)
    for (int j = 0; j < NV; ++j) acc[kk][j] = lanes::zero();
  for (int64_t d = 0; d < D; ++d) {
    Vec qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = lanes::load(qt + d * R + (v0 + j) * kLanes);
    for (int kk = 0; kk < NK; ++kk) {
      const Vec kd = lanes::splat(to_float(k[kk * D + d]));
      for (int j = 0; j < NV; ++j) acc[kk][j] = lanes::fmadd(kd, qv[j], acc[kk][j]);
    }
  }
  for (int kk = 0; kk < NK; ++kk)
    for (int j = 0; j < NV; ++j) lanes::store(s + kk * R + (v0 + j) * kLanes, acc[kk][j]);
}

// A tile of NV vectors of rows, or of nv when fewer remain: only the tile widths a build
// can use are instantiated (up to kRowVectors).
template <int NK, int NV, typename T>
inline void score_tile_of(int64_t nv, const float* qt, int64_t R, int64_t v0, const T* k,
                          int64_t D, float* s) {
  if constexpr (NV > 1) {
    if (nv < NV) return score_tile_of<NK, NV - 1>(nv, qt, R, v0, k, D, s);
  }
  score_tile<NK, NV>(qt, R, v0, k, D, s);
}

template <int NK, typename T>
inline void score_keys(const float* qt, int64_t R, const T* k, int64_t D, float* s) {
  const int64_t vectors = R / lanes::kLanes;
  for (int64_t v0 = 0; v0 < vectors; v0 += kRowVectors)
    score_tile_of<NK, kRowVectors>(vectors - v0, qt, R, v0, k, D, s);
}
#endif

// s[key][row] for the keys [first, n): q·k for every row of the tile. bf16 keys are
// widened a run at a time into `wide` (block_size x D floats), so the inner loop
// broadcasts a float from memory instead of widening each key value once per row vector.
template <typename T>
void scores_pass(const float* qt, int64_t R, const T* k, const int32_t* table, int64_t first,
                 int64_t n, int64_t block_size, int64_t D, float* s, float* wide) {
  for_each_run(k, D, table, first, n, block_size, [&](int64_t slot, int64_t at, int64_t count) {
    const float* rows;
    if constexpr (std::is_same_v<T, float>) {
      rows = k + slot * D;
    } else {
      const T* src = k + slot * D;
      int64_t i = 0;
#ifdef LANES_VECTORS
      for (; i + lanes::kLanes <= count * D; i += lanes::kLanes)
        lanes::store(wide + i, lanes::load(src + i));
#endif
      for (; i < count * D; ++i) wide[i] = to_float(src[i]);
      rows = wide;
    }
    int64_t t = 0;
#ifdef LANES_VECTORS
    for (; t + 4 <= count; t += 4) score_keys<4>(qt, R, rows + t * D, D, s + (at + t) * R);
    for (; t < count; ++t) score_keys<1>(qt, R, rows + t * D, D, s + (at + t) * R);
#endif
    for (; t < count; ++t)
      for (int64_t r = 0; r < R; ++r) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += rows[t * D + d] * qt[d * R + r];
        s[(at + t) * R + r] = acc;
      }
  });
}

// Softmax numerators in place down each row's keys [lo[r], hi[r]) of the len keys, 0
// elsewhere. sums[r]: the row's sum (0 if it sees no key: a padding row).
void softmax_columns(float* s, int64_t R, int64_t len, const int32_t* lo, const int32_t* hi,
                     float* sums) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#ifdef LANES_VECTORS
  using lanes::Vec, lanes::kLanes;
  for (int64_t v = 0; v < R / kLanes; ++v) {
    const lanes::Ints lo_v = lanes::load_ints(lo + v * kLanes),
                      hi_v = lanes::load_ints(hi + v * kLanes);
    auto visible = [&](int64_t t) {  // lanes with lo <= t < hi
      return lanes::in_range(static_cast<int32_t>(t), lo_v, hi_v);
    };
    Vec m = lanes::splat(neg_inf), sum = lanes::zero();
    for (int64_t t = 0; t < len; ++t)
      m = lanes::max_where(visible(t), m, lanes::load(s + t * R + v * kLanes));
    for (int64_t t = 0; t < len; ++t) {
      float* p = s + t * R + v * kLanes;
      // Lanes that cannot see key t get 0 (whatever exp made of them is dropped).
      const Vec e =
          lanes::zero_unless(visible(t), exp_nonpositive(lanes::sub(lanes::load(p), m)));
      lanes::store(p, e);
      sum = lanes::add(sum, e);
    }
    lanes::store(sums + v * kLanes, sum);
  }
#else
  for (int64_t r = 0; r < R; ++r) {
    float m = neg_inf, sum = 0.f;
    for (int64_t t = lo[r]; t < hi[r]; ++t) m = std::max(m, s[t * R + r]);
    for (int64_t t = 0; t < len; ++t) {
      const float e = t >= lo[r] && t < hi[r] ? exp_nonpositive(s[t * R + r] - m) : 0.f;
      s[t * R + r] = e;
      sum += e;
    }
    sums[r] = sum;
  }
#endif
}

// T: q and out; KV: the pools (bfloat16 under float32 q with `--kv-cache-dtype bfloat16`).
template <typename T, typename KV>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& query_starts,
             const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
             double scale, int64_t window, at::Tensor& out) {
  const int64_t S = query_starts.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t G = H / KVH;
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  const int32_t* qlens = query_lens.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t table_row = block_tables.stride(0);
  const T* q_ptr = q.const_data_ptr<T>();
  const KV* k_ptr = k_cache.const_data_ptr<KV>();
  const KV* v_ptr = v_cache.const_data_ptr<KV>();
  T* out_ptr = out.mutable_data_ptr<T>();

  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first new token)
  for (int64_t b = 0; b < S; ++b)
    for (int64_t i0 = 0; i0 < qlens[b]; i0 += TILE) tiles.emplace_back(b, i0);

  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * KVH, 1, [&](int64_t begin,
                                                                       int64_t end) {
    const int64_t max_rows = (TILE * G + 15) / 16 * 16;
    std::vector<float> qt(D * max_rows), acc(max_rows * D), sums(max_rows), s,
        wide(block_size * D);
    std::vector<int32_t> lo(max_rows), hi(max_rows);
    for (int64_t unit = begin; unit < end; ++unit) {
      const auto [b, i0] = tiles[unit / KVH];
      const int64_t h = unit % KVH;
      const int64_t tq = std::min<int64_t>(TILE, qlens[b] - i0);
      const int64_t rows = tq * G, R = (rows + 15) / 16 * 16;
      const int64_t pos0 = lens[b] - qlens[b] + i0;  // position of the tile's first token
      auto first_seen = [&](int64_t p) {
        return window > 0 ? std::max<int64_t>(0, p + 1 - window) : int64_t{0};
      };
      const int64_t first = first_seen(pos0), n = pos0 + tq, len = n - first;
      for (int64_t r = 0; r < R; ++r) {  // padding rows see nothing
        const int64_t p = pos0 + r / G;
        lo[r] = r < rows ? static_cast<int32_t>(first_seen(p) - first) : 0;
        hi[r] = r < rows ? static_cast<int32_t>(p + 1 - first) : 0;
      }
      std::fill(qt.begin(), qt.begin() + D * R, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = q_ptr + (starts[b] + i0 + r / G) * q.stride(0) +
                       (h * G + r % G) * q.stride(1);
        for (int64_t d = 0; d < D; ++d)
          qt[d * R + r] = to_float(src[d]) * static_cast<float>(scale);
      }
      s.resize(len * R);
      const int32_t* table = tables + b * table_row;
      scores_pass(qt.data(), R, k_ptr + h * num_slots * D, table, first, n, block_size, D,
                  s.data(), wide.data());
      softmax_columns(s.data(), R, len, lo.data(), hi.data(), sums.data());
      values_pass(s.data(), v_ptr + h * num_slots * D, table, first, n, block_size, R, D,
                  acc.data(), 1, R);
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / sums[r];
        T* o = out_ptr + (starts[b] + i0 + r / G) * out.stride(0) +
               (h * G + r % G) * out.stride(1);
        for (int64_t d = 0; d < D; ++d) o[d] = T(acc[r * D + d] * inv);
      }
    }
  });
}

void paged_prefill_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& block_tables,
                    const at::Tensor& query_starts, const at::Tensor& query_lens,
                    const at::Tensor& context_lens, int64_t block_size, double scale,
                    int64_t window) {
  check_prefill_args(out, q, k_cache, v_cache, block_tables, query_starts, query_lens,
                     context_lens, block_size);
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat) {
    prefill<float, float>(q, k_cache, v_cache, block_tables, query_starts, query_lens,
                          context_lens, block_size, scale, window, out);
  } else if (q.scalar_type() == at::kFloat) {
    prefill<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, query_starts, query_lens,
                                  context_lens, block_size, scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    prefill<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, query_starts,
                                          query_lens, context_lens, block_size, scale, window,
                                          out);
  } else {
    TORCH_CHECK(false, "paged_prefill_ takes float32 or bfloat16, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("paged_prefill_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_starts, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale, int window) -> ()");
  m.impl("paged_prefill_", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_));
}
