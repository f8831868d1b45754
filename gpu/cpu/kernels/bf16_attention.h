// The bf16 attention kernels' shared pieces (paged_prefill_bf16.cpp,
// cascade_decode_amx.cpp through amx_attention.h): keys and values packed for bf16
// products (kt [D/2][L] words, each a key's dims 2i, 2i+1; vp [L/2][D] words, each a dim
// of keys 2j, 2j+1: the AMX tile unit's B layout, which AVX512-BF16's vdpbf16ps reads as
// it stands, a word a lane), the prefill's row softmax that rounds p to bf16, and the
// matmul of those layouts by dot products (`dot_matmul`) for CPUs without the tile unit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lanes.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace bf16_attention {

inline constexpr int64_t kTile = 16;    // rows of a tile; columns of a B or C tile
inline constexpr int64_t kChunk = 32;   // bf16 values in a tile row: the k of one product

// A pair of equal-length uint16 rows as words (a[i] low, b[i] high), 32 values a time.
inline void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t D, uint16_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t d = 0; d < D; d += kChunk) {
    const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + 2 * d + kChunk, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// 16 rows of 16 words transposed in place: four butterfly stages, stage w swapping bit
// w of the row index with bit w of the column index. The stages' lane indices are tables
// built at compile time (vectors assembled from scalar stores stall the load on them).
struct Stage {  // lo: row i's own low half, then p's; hi: i's high half, then p = i + w's
  alignas(64) int32_t lo[16], hi[16];
};
constexpr Stage stage(int w) {
  Stage s{};
  for (int j = 0; j < 16; ++j) {
    s.lo[j] = (j & w) ? 16 + j - w : j;
    s.hi[j] = (j & w) ? 16 + j : j + w;
  }
  return s;
}
alignas(64) inline constexpr Stage kStages[4] = {stage(8), stage(4), stage(2), stage(1)};

inline void transpose16(__m512i r[16]) {
  for (int si = 0, w = 8; si < 4; ++si, w /= 2) {
    const __m512i lo = _mm512_load_si512(kStages[si].lo), hi = _mm512_load_si512(kStages[si].hi);
    for (int i = 0; i < 16; ++i) {
      if (i & w) continue;
      const __m512i a = r[i], b = r[i + w];
      r[i] = _mm512_permutex2var_epi32(a, lo, b);
      r[i + w] = _mm512_permutex2var_epi32(a, hi, b);
    }
  }
}

// Packs one (sequence, KV head): kt [D/2][L] and vp [L/2][D] words (see the top). While
// one group of 16 keys is transposed, the next group's keys are fetched into L1 and this
// group's values into L2: each group may be another block, where the hardware
// prefetcher starts over.
inline void pack(const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* table,
                 int64_t first, int64_t n, int64_t block_size, int64_t D, int64_t L,
                 uint32_t* kt, uint16_t* vp) {
  const int64_t len = n - first;
  auto row = [&](const uint16_t* pool, int64_t t) {
    return pool + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * D;
  };
  __m512i r[16];
  for (int64_t j0 = 0; j0 < L; j0 += kTile) {
    const uint16_t* keys[kTile];
    for (int64_t jj = 0; jj < kTile; ++jj)
      keys[jj] = j0 + jj < len ? row(k_pool, first + j0 + jj) : nullptr;
    for (int64_t jj = 0; jj < kTile; ++jj) {
      const int64_t next = j0 + kTile + jj;
      for (int64_t o = 0; o < 2 * D; o += 64) {
        if (next < len)
          _mm_prefetch(reinterpret_cast<const char*>(row(k_pool, first + next)) + o, _MM_HINT_T0);
        if (j0 + jj < len)
          _mm_prefetch(reinterpret_cast<const char*>(row(v_pool, first + j0 + jj)) + o,
                       _MM_HINT_T1);
      }
    }
    for (int64_t i0 = 0; i0 < D / 2; i0 += kTile) {
      for (int64_t jj = 0; jj < kTile; ++jj)
        r[jj] = keys[jj] ? _mm512_loadu_si512(keys[jj] + 2 * i0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t ii = 0; ii < kTile; ++ii) _mm512_storeu_si512(kt + (i0 + ii) * L + j0, r[ii]);
    }
  }
  const std::vector<uint16_t> zeros(D, 0);
  for (int64_t j = 0; j < L; j += 2) {
    const uint16_t* a = j < len ? row(v_pool, first + j) : zeros.data();
    const uint16_t* b = j + 1 < len ? row(v_pool, first + j + 1) : zeros.data();
    interleave_rows(a, b, D, vp + j * D);
  }
}

// 2^t for t <= 0, good to a few parts in 1e5: enough for p, which is rounded to bf16
// (8 significant bits) before p·v. exp_nonpositive (fast_exp.h) is good to ~1 ulp of
// fp32 at several times the operations, and the softmax is most of this kernel's time
// once the products run on the tile unit. t = n + f with n an integer and |f| <= 1/2;
// 2^f by its Taylor series to degree 4 (the next term is below 5e-5 of it); scalef
// multiplies by 2^n and underflows to 0 far below the row's maximum.
inline __m512 exp2_nonpositive(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);                       // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));       // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));       // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));       // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// p [W] bf16 = the softmax numerators of s [W] * scale over [lo, hi), 0 elsewhere;
// returns their fp32 sum. Two passes (max; exp, sum and bf16), lane masks only where a
// chunk straddles lo or hi, four running maxima so the max is not one long chain.
inline float softmax_row(const float* s, int64_t W, int64_t lo, int64_t hi, float scale,
                         uint16_t* p) {
  using lanes::Vec;
  const __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto seen = [&](int64_t j) -> __mmask16 {  // lanes j + l with lo <= j + l < hi
    if (j >= lo && j + kTile <= hi) return 0xFFFF;
    const __m512i key = _mm512_add_epi32(ids, _mm512_set1_epi32(static_cast<int32_t>(j)));
    return static_cast<__mmask16>(
        _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(lo))) &
        _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(hi))));
  };
  const int64_t from = lo / kTile * kTile, to = (hi + kTile - 1) / kTile * kTile;
  const Vec none = lanes::splat(-std::numeric_limits<float>::infinity());
  Vec m[4] = {none, none, none, none};
  int64_t j = from;
  for (; j + 4 * kTile <= to; j += 4 * kTile)
    for (int u = 0; u < 4; ++u)
      m[u] = lanes::max_where(seen(j + u * kTile), m[u], lanes::load(s + j + u * kTile));
  for (; j < to; j += kTile) m[0] = lanes::max_where(seen(j), m[0], lanes::load(s + j));
  const float top = lanes::max_lanes(_mm512_max_ps(_mm512_max_ps(m[0], m[1]),
                                                   _mm512_max_ps(m[2], m[3])));
  // e^(scale (s - max)) = 2^(s log2(e) scale - max log2(e) scale): one FMA a lane; lanes
  // not seen may exceed the max (even to inf) and are zeroed after.
  const float k = scale * 1.44269504088896341f;
  const Vec sc = lanes::splat(k), shift = lanes::splat(-top * k);
  Vec sum[2] = {lanes::zero(), lanes::zero()};
  std::fill(p, p + from, uint16_t{0});
  for (j = from; j < to; j += kTile) {
    const Vec t = lanes::fmadd(lanes::load(s + j), sc, shift);
    const Vec e = lanes::zero_unless(seen(j), exp2_nonpositive(t));
    sum[(j / kTile) & 1] = lanes::add(sum[(j / kTile) & 1], e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  std::fill(p + to, p + W, uint16_t{0});
  return lanes::sum_lanes(lanes::add(sum[0], sum[1]));
}

template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// c [M][N] fp32 (row stride ldc floats) = a [M][K] bf16 (row stride lda) · b, b K/2 word
// rows of N columns (row stride ldb words), as amx_attention.h's `matmul` computes it,
// with vdpbf16ps: per word row of b, each of 4 rows of a has its pair of values
// broadcast and multiplied into up to 4 vectors of 16 columns: bf16 products summed in
// fp32, as the tile unit sums them, in another order. M a multiple of 4, N of 16, K
// even. Columns outer, rows inner: a block of b (64 columns, K/2 rows) stays in L1
// while every row block passes under it.
template <int NV>
inline void dot_block(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                      int64_t K, float* c, int64_t ldc) {
  constexpr int R = 4;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) {
      const __m512i w = _mm512_loadu_si512(b + k2 * ldb + kTile * v);
      bv[v] = reinterpret_cast<const __m512bh&>(w);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * k2, 4);
      const __m512i av = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<const __m512bh&>(av), bv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + kTile * v, acc[r][v]);
}

inline void dot_matmul(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                       int64_t M, int64_t N, int64_t K, float* c, int64_t ldc) {
  for (int64_t n0 = 0; n0 < N; n0 += 4 * kTile) {
    const int64_t nv = std::min<int64_t>(4, (N - n0) / kTile);
    for (int64_t m = 0; m < M; m += 4) {
      const uint16_t* am = a + m * lda;
      float* cm = c + m * ldc + n0;
      switch (nv) {
        case 4: dot_block<4>(am, lda, b + n0, ldb, K, cm, ldc); break;
        case 3: dot_block<3>(am, lda, b + n0, ldb, K, cm, ldc); break;
        case 2: dot_block<2>(am, lda, b + n0, ldb, K, cm, ldc); break;
        default: dot_block<1>(am, lda, b + n0, ldb, K, cm, ldc); break;
      }
    }
  }
}

}  // namespace bf16_attention
#endif
