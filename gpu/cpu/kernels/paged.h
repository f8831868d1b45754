// What the paged attention kernels share (paged_decode.cpp, paged_prefill.cpp): loads
// that widen bf16, the block-table walk with its prefetch, and the p·v pass (AVX-512 or
// AVX2 paths, portable loops otherwise).
//
// Layout: k_cache/v_cache [num_kv_heads, num_slots, head_dim], slot = block *
// block_size + offset; block tables are int32 rows of pool block ids.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "lanes.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace paged {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Loads that widen bf16 (lanes.h).
#ifdef __AVX512F__
using lanes::load16;
#elif defined(__AVX2__) && defined(__FMA__)
using lanes::load8;
#endif

// Asks for `rows` rows of D values from `p` to be brought into L1 ahead of use.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t D) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t size = rows * D * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < size; o += 64) _mm_prefetch(bytes + o, _MM_HINT_T0);
#endif
}

// The keys [first, n) of one sequence in `pool` (rows of D), a block-table walk at a
// time: calls fn(pool_row_offset, index_from_first, count) for each run of consecutive
// slots. Each block is a jump to another 4 KB (block_size 16, D 64, fp32), where the
// hardware prefetcher starts over, so the next run is prefetched before this one is
// used (benchmarks/cpu_decode_ab.py).
template <typename T, typename Fn>
inline void for_each_run(const T* pool, int64_t D, const int32_t* table, int64_t first,
                         int64_t n, int64_t block_size, Fn&& fn) {
  for (int64_t t = first; t < n;) {
    const int64_t j = t / block_size, off = t % block_size;
    const int64_t count = std::min(block_size - off, n - t);
    if (t + count < n)
      prefetch_rows(pool + static_cast<int64_t>(table[j + 1]) * block_size * D,
                    std::min(block_size, n - t - count), D);
    fn(static_cast<int64_t>(table[j]) * block_size + off, t - first, count);
    t += count;
  }
}

#ifdef LANES_VECTORS
// acc[g0 .. g0+GN) x [d0, d0 + 4 kLanes) += sum over the run's `count` keys of p * v, kept
// in GN x 4 registers for the whole run (AVX-512: 64 dims, AVX2: 32). The probability of
// row g and key k is probs[g * row_stride + k * key_stride] (decode: rows of keys;
// prefill: keys of rows).
template <int GN, typename T>
inline void values_tile(const float* probs, const T* rows, int64_t at, int64_t count,
                        int64_t g0, int64_t d0, int64_t D, float* acc, int64_t row_stride,
                        int64_t key_stride) {
  using lanes::fmadd, lanes::kLanes, lanes::load, lanes::splat, lanes::Vec;
  Vec a[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = load(acc + (g0 + g) * D + d0 + kLanes * j);
  for (int64_t t = 0; t < count; ++t) {
    const T* r = rows + t * D + d0;
    const Vec v0 = load(r), v1 = load(r + kLanes), v2 = load(r + 2 * kLanes),
              v3 = load(r + 3 * kLanes);
    for (int g = 0; g < GN; ++g) {
      const Vec p = splat(probs[(g0 + g) * row_stride + (at + t) * key_stride]);
      a[g][0] = fmadd(p, v0, a[g][0]);
      a[g][1] = fmadd(p, v1, a[g][1]);
      a[g][2] = fmadd(p, v2, a[g][2]);
      a[g][3] = fmadd(p, v3, a[g][3]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < 4; ++j) lanes::store(acc + (g0 + g) * D + d0 + kLanes * j, a[g][j]);
}
#endif

// acc [G, D] = sum over the keys [first, n) of p * v (probabilities laid out as above).
template <typename T>
void values_pass(const float* probs, const T* v, const int32_t* table, int64_t first, int64_t n,
                 int64_t block_size, int64_t G, int64_t D, float* acc, int64_t row_stride,
                 int64_t key_stride) {
  std::fill(acc, acc + G * D, 0.f);
  for_each_run(v, D, table, first, n, block_size, [&](int64_t slot, int64_t at, int64_t count) {
    const T* rows = v + slot * D;
#ifdef __AVX512F__
    if (D % 64 == 0) {
      // Tiles of up to 4 heads x 64 dims, 16 accumulator registers: each value row is
      // loaded once for the tile's heads, and the FMAs into different registers do not
      // wait on each other (one accumulator per head and 16 dims made every FMA wait
      // for the previous one).
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          switch (std::min<int64_t>(4, G - g0)) {
            case 4: values_tile<4>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
            case 3: values_tile<3>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
            case 2: values_tile<2>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
            default: values_tile<1>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
          }
        }
      }
      return;
    }
    if (D % 16 == 0) {
      // One accumulator register per (head, 16 dims) across the run; the run's values
      // are re-read per head from L1.
      for (int64_t g = 0; g < G; ++g) {
        const float* p = probs + g * row_stride + at * key_stride;
        for (int64_t d = 0; d < D; d += 16) {
          __m512 a = _mm512_loadu_ps(acc + g * D + d);
          for (int64_t t = 0; t < count; ++t)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[t * key_stride]), load16(rows + t * D + d), a);
          _mm512_storeu_ps(acc + g * D + d, a);
        }
      }
      return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // AVX2 has 16 registers: tiles of up to 3 heads x 32 dims, 12 accumulators.
    if (D % 32 == 0) {
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
          switch (std::min<int64_t>(3, G - g0)) {
            case 3: values_tile<3>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
            case 2: values_tile<2>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
            default: values_tile<1>(probs, rows, at, count, g0, d0, D, acc, row_stride, key_stride); break;
          }
        }
      }
      return;
    }
#endif
    for (int64_t t = 0; t < count; ++t) {
      const T* r = rows + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = probs[g * row_stride + (at + t) * key_stride];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * to_float(r[d]);
      }
    }
  });
}

}  // namespace paged
