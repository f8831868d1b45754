// The exact quant kernels' AVX2 path (quant_linear.cpp has the algorithm and the AVX-512
// path): 16 registers of 8 lanes and no masks, so the two paths it keeps, per-block
// scaling up to kPerBlockMaxRows rows and the L1 buffer above, work in 8-output groups,
// and there is no direct path (widening a block again for each tile needs registers
// AVX2 does not have).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

namespace quant::avx2 {

// Lanes [0, n) of an 8-lane mask (n >= 8: all), for the last panel's partial groups.
inline __m256i lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Loads and stores of a tile's outputs: plain where all 8 lanes exist (every panel but
// a last partial one), masked otherwise. Masked moves are microcoded on some AVX2 CPUs
// (several times a plain pair), and the buffered path moves its accumulators once per
// chunk of k, so the common case takes plain ones.
inline __m256 load_out8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(n));
}
inline void store_out8(float* p, int64_t n, __m256 v) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else if (n > 0) _mm256_maskstore_ps(p, lanes8(n), v);
}

// The levels of a block kPrefetchBlocks ahead (the next panel's first ones near a panel's
// end: panels lie one after another; past the last panel, addresses a prefetch may name
// without faulting) asked into L1 before they are needed. At 1-4 rows the
// kernel reads weights faster than the hardware prefetcher brings them in, most of all
// for the Q8_0 head's large blocks (1 KB of levels each); two blocks ahead is as good
// as more (benchmarks/cpu_quant_linear_ab.py).
constexpr int64_t kPrefetchBlocks = 2;
template <typename W>
inline void prefetch_levels(const void* levels) {
  const char* at = static_cast<const char*>(levels);
  for (int64_t line = 0; line < W::kLevelBytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
}

// T x rows against C groups of 8 outputs (from group g0) of panel p, scales applied once
// per block as in quant_linear.cpp's tile_per_block. Sums of q * x for k = j and
// k = j + 16 go to separate registers: 2 T C independent FMA chains (one would wait on
// the FMA before it). Every loop over t and c is unrolled by pragma, so that GCC 12 turns
// the [T][C] arrays into registers: without it the sums went to the stack and back on
// every FMA (a store-to-load wait in each chain), and the kernel ran at about half speed.
template <int T, int C, typename W>
inline void tile_per_block8(const W& w, int64_t p, int g0, const float* x, int64_t xs,
                            const float* x_sums, int64_t ks, float* out, int64_t os,
                            int64_t cols) {
  __m256 acc[T][C];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    const auto* q = w.levels_at(p, b);
    if (g0 == 0) prefetch_levels<W>(w.levels_at(p, b + kPrefetchBlocks));
    __m256 lo[T][C], hi[T][C];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) lo[t][c] = hi[t][c] = _mm256_setzero_ps();
    for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        __m256 ql, qh;
        W::levels8(q, j, g0 + c, ql, qh);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const float* xr = x + t * xs + b * kBlock + j;
          lo[t][c] = _mm256_fmadd_ps(ql, _mm256_broadcast_ss(xr), lo[t][c]);
          hi[t][c] = _mm256_fmadd_ps(qh, _mm256_broadcast_ss(xr + 16), hi[t][c]);
        }
      }
    }
    const int64_t at = w.at(p, b);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[t][c] = w.add_block8(at, g0 + c, lo[t][c], hi[t][c], x_sums[t * ks + b],
                                 acc[t][c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = 8 * (g0 + c);
    if (n0 >= cols) break;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) store_out8(out + t * os + n0, cols - n0, acc[t][c]);
  }
}

// R x rows against kc widened k of a panel (wbuf: [kc][32]), 16 outputs at a time,
// added to what `out` holds unless this is the first chunk (as quant_linear.cpp's
// tile_buffered).
template <int R>
inline void tile_buffered8(const float* wbuf, int64_t kc, const float* x, int64_t xs, float* out,
                           int64_t os, int64_t cols, bool first) {
  for (int64_t n0 = 0; n0 < cols; n0 += 16) {
    const int64_t n = cols - n0;  // outputs left from n0
    __m256 acc[R][2];
    for (int t = 0; t < R; ++t) {
      acc[t][0] = first ? _mm256_setzero_ps() : load_out8(out + t * os + n0, n);
      acc[t][1] = first ? _mm256_setzero_ps() : load_out8(out + t * os + n0 + 8, n - 8);
    }
    for (int64_t k = 0; k < kc; ++k) {
      const __m256 w0 = _mm256_loadu_ps(wbuf + k * kPanel + n0);
      const __m256 w1 = _mm256_loadu_ps(wbuf + k * kPanel + n0 + 8);
      for (int t = 0; t < R; ++t) {
        const __m256 xv = _mm256_broadcast_ss(x + t * xs + k);
        acc[t][0] = _mm256_fmadd_ps(w0, xv, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w1, xv, acc[t][1]);
      }
    }
    for (int t = 0; t < R; ++t) {
      store_out8(out + t * os + n0, n, acc[t][0]);
      store_out8(out + t * os + n0 + 8, n - 8, acc[t][1]);
    }
  }
}

// out [M, N] = x [M, K] (row stride xs) @ W.T, parallel over panels.
template <typename W>
void quant_linear(const W& w, const float* x_ptr, int64_t M, int64_t xs, int64_t N,
                  float* out_ptr) {
  const int64_t K = w.K, panels = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  const int64_t blocks = K / kBlock;
  if (M <= kPerBlockMaxRows) {
    const std::vector<float> x_sums = block_sums(x_ptr, M, xs, blocks);
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        float* o = out_ptr + p * kPanel;
        with_rows<kPerBlockMaxRows>(M, [&](auto T) {
          constexpr int kT = decltype(T)::value;
          constexpr int kC = kT == 1 ? 4 : kT == 2 ? 2 : 1;  // 3 T C registers at most 12
          for (int g0 = 0; g0 < 4; g0 += kC)
            tile_per_block8<kT, kC>(w, p, g0, x_ptr, xs, x_sums.data(), blocks, o, N, cols);
        });
      }
    });
    return;
  }
  const int64_t tiles = (M + kTile - 1) / kTile, tile = (M + tiles - 1) / tiles;
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> wbuf(kChunk * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t b = k0 / kBlock; b < (k0 + kc) / kBlock; ++b) {
          const auto* q = w.levels_at(p, b);
          const int64_t at = w.at(p, b);
          for (int j = 0; j < 16; ++j) {
            float* row = wbuf.data() + (b * kBlock - k0 + j) * kPanel;
            for (int g = 0; g < 4; ++g) {
              __m256 lo, hi;
              w.widen8(q, at, j, g, lo, hi);
              _mm256_storeu_ps(row + 8 * g, lo);
              _mm256_storeu_ps(row + 16 * kPanel + 8 * g, hi);
            }
          }
        }
        for (int64_t r0 = 0; r0 < M; r0 += tile) {
          with_rows(std::min(tile, M - r0), [&](auto R) {
            tile_buffered8<decltype(R)::value>(wbuf.data(), kc, x_ptr + r0 * xs + k0, xs,
                                               out_ptr + r0 * N + p * kPanel, N, cols,
                                               k0 == 0);
          });
        }
      }
    }
  });
}

}  // namespace quant::avx2
