// The AVX512-VNNI int8 kernels' shared pieces (quant_linear_int8.cpp has the algorithm
// and the entry points): a half panel's lanes, the byte gather from a block's [k][32]
// rows to vpdpbusd's [output][4 k], a row's 4 x levels broadcast; and the tile for
// Q8_16 (a Q6_K's or Q3_K's levels, q8_16_blocks.h).
//
// Q8_16: per panel its blocks' 6-bit levels are unpacked once into a thread's buffer in
// Q8_0's layout (signed int8 [K/32][32 k][32 outputs], `Q8_16::unpack`), which every half
// and row tile of the panel then reads as the Q8_0 tile reads its panel: x's levels made
// unsigned (+128, once, as they are quantized) against the signed weights, 128 * sum(q_w)
// taken off, the integer sums exact; but summed per half block (16 k), each scaled by its
// own scale (code * super).
#pragma once

#include <cstdint>
#include <cstring>

#include "q8_16_blocks.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>

namespace quant::int8_avx512 {

// Lanes of half h that exist when the panel has `cols` outputs.
inline __mmask16 half_mask(int half, int64_t cols) {
  __mmask16 masks[2];
  column_masks(cols, masks[0], masks[1]);
  return masks[half];
}

// vpermt2b indices: output lane n (of the half's 16), byte i <- row 4g + i of the
// 128 bytes loaded from rows 4g..4g+3 (32 outputs each), output 16 * half + n.
inline __m512i gather_index(int half) {
  alignas(64) uint8_t idx[64];
  for (int n = 0; n < 16; ++n)
    for (int i = 0; i < 4; ++i) idx[n * 4 + i] = static_cast<uint8_t>(i * 32 + 16 * half + n);
  return _mm512_load_si512(idx);
}

// The 4 k bytes (rows 4g..4g+3 of a block's [j][32] bytes) of the half's 16 outputs.
inline __m512i gather_group(const uint8_t* rows, __m512i index) {
  return _mm512_permutex2var_epi8(_mm512_loadu_si512(rows), index,
                                  _mm512_loadu_si512(rows + 2 * kPanel));
}

inline __m512i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// T rows of x (levels from row r0, stored as q + 128) against half `half` of Q8_16 panel
// p, whose levels `levels` holds unpacked.
template <int T, typename Rows>
inline void tile_q8_16(const Q8_16& w, const int8_t* levels, int64_t p, int half,
                       const Rows& x, int64_t r0, float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = half_mask(half, cols);
  const __m512i index = gather_index(half), ones = _mm512_set1_epi8(1);
  const int64_t blocks = w.K / kBlock;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = reinterpret_cast<const uint8_t*>(levels + b * kBlock * kPanel);
    const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d.data() + b * x.M + r0;
    const int64_t g = w.global(p, b);
    for (int h = 0; h < 2; ++h) {  // k = 16h .. 16h + 15, one scale
      __m512i dot[T], wsum = _mm512_setzero_si512();
      for (int t = 0; t < T; ++t) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        const __m512i lv = gather_group(q + 4 * j * kPanel, index);
        wsum = _mm512_dpbusd_epi32(wsum, ones, lv);
        for (int t = 0; t < T; ++t)
          dot[t] = _mm512_dpbusd_epi32(dot[t], broadcast4(xq + t * kBlock + 4 * j), lv);
      }
      const __m512i bias = _mm512_slli_epi32(wsum, 7);  // 128 * sum(q_w)
      const __m512 d = Q8_16::scales16(w.codes + (2 * g + h) * kPanel + 16 * half,
                                       w.supers + (g / 8) * kPanel + 16 * half);
      for (int t = 0; t < T; ++t) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[t], bias));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sums, _mm512_set1_ps(xd[t])), d, acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os + 16 * half, mask, acc[t]);
}

}  // namespace quant::int8_avx512
#endif
