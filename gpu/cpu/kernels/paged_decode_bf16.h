// The two passes of paged_decode.cpp for a bf16 q over bf16 pools, on AVX-512 with BF16.
//
// Why: at batch 32 the decode kernel's instructions, not its bytes, were most of its time:
// every key row was widened to fp32 once per query head of the GQA group (two
// instructions a vector beside the FMA), and every value row with a cross-lane widen.
// Here:
//   - q·k runs on vdpbf16ps straight from the bf16 rows: each instruction multiplies 32
//     bf16 pairs exactly (the products of two bf16 fit in fp32) and adds them into fp32
//     lanes, so a score is the fp32 sum of the same exact products as before in another
//     order; the scale multiplies the sum instead of q (exact for a power-of-two scale).
//     The instruction treats bf16 denormals as zero (the pools never hold any in practice:
//     |x| < 1.2e-38).
//   - p·v widens 32 values with two plain bit operations (the even lanes shifted up, the
//     odd lanes masked), no cross-lane shuffle, so the accumulators hold each 32 dims as
//     their 16 even then their 16 odd dims; `finish` puts them back in order. Each dim's
//     sum is the one the portable pass computes, in the same order.
//   - the requests for what comes next are spread over the work, a row per key: the
//     scores pass asks for the next run's keys (L1) and this run's values (L2), the value
//     pass for the next run's values (L1) and the task's next keys (L2). Asked for a block
//     at a time, the requests stalled the loops until the line fill buffers drained, and
//     the memory time added to the compute instead of hiding under it.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "paged.h"
#include "reduce.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGED_DECODE_BF16 1

namespace paged_bf16 {

using BF16 = c10::BFloat16;

inline __m512bh load_pairs(const BF16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Asks for `rows` rows of D bf16 values to come into L2 (the value pass reads them later).
inline void prefetch_l2(const BF16* p, int64_t rows, int64_t D) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t size = rows * D * static_cast<int64_t>(sizeof(BF16));
  for (int64_t o = 0; o < size; o += 64) _mm_prefetch(bytes + o, _MM_HINT_T1);
}

// Row t of the rows at p (if any) asked for, into L1 (T0) or L2 (T1). The passes ask for
// the next run's rows a row at a time as they work through this run's: a burst of a
// whole block's requests stalls the loop until the line fill buffers drain, where the
// same requests spread between the products overlap with them.
template <int hint>
inline void prefetch_row(const BF16* p, int64_t t, int64_t D) {
  if (p == nullptr) return;
  const char* bytes = reinterpret_cast<const char*>(p + t * D);
  for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(BF16)); o += 64)
    _mm_prefetch(bytes + o, static_cast<_mm_hint>(hint));
}

// The keys [first, n) of a pool head, run by run as for_each_run walks them, with the
// next run's rows (nullptr after the last) for the pass to ask for as it goes.
template <typename Fn>
inline void walk(const BF16* pool, int64_t D, const int32_t* table, int64_t first, int64_t n,
                 int64_t block_size, Fn&& fn) {
  for (int64_t t = first; t < n;) {
    const int64_t j = t / block_size, off = t % block_size;
    const int64_t count = std::min(block_size - off, n - t);
    const BF16* next = t + count < n
        ? pool + static_cast<int64_t>(table[j + 1]) * block_size * D : nullptr;
    fn(static_cast<int64_t>(table[j]) * block_size + off, t - first, count, next);
    t += count;
  }
}

// scores[g * len + i] = scale * (q_g · k_(first + i)) for the keys [first, n); q_g is
// q + g * q_head (D % 32 == 0). Asks for the next run's keys (L1) and this run's values
// (L2, for the value pass) as it goes.
inline void scores_pass(const BF16* q, int64_t q_head, const BF16* k, const BF16* v,
                        const int32_t* table, int64_t first, int64_t n, int64_t block_size,
                        int64_t G, int64_t D, float scale, float* scores, int64_t len) {
  const __m128 sc4 = _mm_set1_ps(scale);
  walk(k, D, table, first, n, block_size,
       [&](int64_t slot, int64_t at, int64_t count, const BF16* next) {
    const BF16* rows = k + slot * D;
    const BF16* values = v + slot * D;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {  // four keys per q load, for each head
      for (int64_t i = t; i < t + 4; ++i) {
        prefetch_row<_MM_HINT_T0>(next, i, D);
        prefetch_row<_MM_HINT_T1>(values, i, D);
      }
      const BF16* r = rows + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const BF16* qg = q + g * q_head;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512bh qv = load_pairs(qg + d);
          a0 = _mm512_dpbf16_ps(a0, qv, load_pairs(r + d));
          a1 = _mm512_dpbf16_ps(a1, qv, load_pairs(r + D + d));
          a2 = _mm512_dpbf16_ps(a2, qv, load_pairs(r + 2 * D + d));
          a3 = _mm512_dpbf16_ps(a3, qv, load_pairs(r + 3 * D + d));
        }
        _mm_storeu_ps(scores + g * len + at + t, _mm_mul_ps(reduce4(a0, a1, a2, a3), sc4));
      }
    }
    for (; t < count; ++t) {
      prefetch_row<_MM_HINT_T1>(values, t, D);
      for (int64_t g = 0; g < G; ++g) {
        const BF16* qg = q + g * q_head;
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32)
          a = _mm512_dpbf16_ps(a, load_pairs(qg + d), load_pairs(rows + t * D + d));
        scores[g * len + at + t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    if (next != nullptr)  // the rest of the next run, past the keys asked for above
      for (int64_t i = t - t % 4; i < block_size; ++i) prefetch_row<_MM_HINT_T0>(next, i, D);
  });
}

// 32 bf16 values as fp32: their even lanes (the bits shifted up) and their odd lanes (the
// low half masked off), each in order.
inline void widen_pairs(const BF16* p, __m512& even, __m512& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(-65536)));
}

// acc[g0 .. g0+GN) x the W * 16 dims at d0 (deinterleaved as above) += sum over the run's
// keys of p * v, held in GN x W registers for the run.
// Asks for row t of `ahead[0]` (L1) and of `ahead[1]` (L2) with each key (prefetch_row).
template <int GN, int W>
inline void values_tile(const float* probs, const BF16* rows, int64_t at, int64_t count,
                        int64_t g0, int64_t d0, int64_t D, float* acc, int64_t len,
                        const BF16* const* ahead) {
  __m512 a[GN][W];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < W; ++j) a[g][j] = _mm512_loadu_ps(acc + (g0 + g) * D + d0 + 16 * j);
  for (int64_t t = 0; t < count; ++t) {
    prefetch_row<_MM_HINT_T0>(ahead[0], t, D);
    prefetch_row<_MM_HINT_T1>(ahead[1], t, D);
    __m512 v[W];
    for (int j = 0; j < W; j += 2) widen_pairs(rows + t * D + d0 + 16 * j, v[j], v[j + 1]);
    for (int g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(probs[(g0 + g) * len + at + t]);
      for (int j = 0; j < W; ++j) a[g][j] = _mm512_fmadd_ps(p, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc + (g0 + g) * D + d0 + 16 * j, a[g][j]);
}

template <int W>
inline void values_tiles(const float* probs, const BF16* rows, int64_t at, int64_t count,
                         int64_t G, int64_t d0, int64_t D, float* acc, int64_t len,
                         const BF16* const* ahead) {
  // Up to 4 heads x 64 dims: 16 accumulators, each value row widened once for them. The
  // first tile asks for the rows ahead.
  const BF16* none[2] = {nullptr, nullptr};
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const BF16* const* pf = g0 == 0 && d0 == 0 ? ahead : none;
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: values_tile<4, W>(probs, rows, at, count, g0, d0, D, acc, len, pf); break;
      case 3: values_tile<3, W>(probs, rows, at, count, g0, d0, D, acc, len, pf); break;
      case 2: values_tile<2, W>(probs, rows, at, count, g0, d0, D, acc, len, pf); break;
      default: values_tile<1, W>(probs, rows, at, count, g0, d0, D, acc, len, pf); break;
    }
  }
}

// The keys a task reads next: a pool head, a block table and the key range [first, n).
struct Keys {
  const BF16* pool = nullptr;
  const int32_t* table = nullptr;
  int64_t first = 0, n = 0;
};

// acc [G, D] (deinterleaved) = sum over the keys [first, n) of p * v; D % 32 == 0. Asks
// for the next run's values (L1) and, run for run, the blocks of `next` (the task's next
// keys: L2), so that its scores pass does not start on a cold miss per block.
inline void values_pass(const float* probs, const BF16* v, const int32_t* table, int64_t first,
                        int64_t n, int64_t block_size, int64_t G, int64_t D, float* acc,
                        int64_t len, const Keys& next) {
  std::fill(acc, acc + G * D, 0.f);
  int64_t ahead = next.first - next.first % block_size;  // next's first key not yet asked for
  walk(v, D, table, first, n, block_size,
       [&](int64_t slot, int64_t at, int64_t count, const BF16* next_run) {
    const BF16* keys = nullptr;
    if (ahead < next.n) {
      keys = next.pool + static_cast<int64_t>(next.table[ahead / block_size]) * block_size * D;
      ahead += block_size;
    }
    const BF16* rows = v + slot * D;
    const BF16* pf[2] = {next_run, keys};
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64)
      values_tiles<4>(probs, rows, at, count, G, d0, D, acc, len, pf);
    if (d0 < D) values_tiles<2>(probs, rows, at, count, G, d0, D, acc, len, pf);
    for (int64_t i = count; i < block_size; ++i) {  // rows the keys above did not reach
      prefetch_row<_MM_HINT_T0>(next_run, i, D);
      prefetch_row<_MM_HINT_T1>(keys, i, D);
    }
    if (next_run == nullptr)  // the last run: the rest of the next task's keys
      for (; ahead < next.n; ahead += block_size) {
        const int64_t block = next.table[ahead / block_size];
        prefetch_l2(next.pool + block * block_size * D, std::min(block_size, next.n - ahead), D);
      }
  });
}

// out [G, D] = acc / sums, the dims back in order, rounded to bf16 as c10 rounds.
inline void finish(const float* acc, const float* sums, int64_t G, int64_t D, BF16* out) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g]);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 even = _mm512_loadu_ps(acc + g * D + d);
      const __m512 odd = _mm512_loadu_ps(acc + g * D + d + 16);
      lanes::store16(out + g * D + d, _mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), inv));
      lanes::store16(out + g * D + d + 16,
                     _mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), inv));
    }
  }
}

}  // namespace paged_bf16
#endif
