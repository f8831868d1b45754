// The int8 kernels' AVX2 half (quant_linear_int8.cpp has the algorithm, the AVX-512
// half and the entry points): x's blocks quantized, and tiles of rows against Q4_1 and
// Q8_0 panels.
//
// AVX2 has no vpdpbusd. Its place is taken by vpmaddubsw, which multiplies 32 unsigned
// bytes by 32 signed ones and adds neighbouring pairs into 16 int16 sums, and
// vpmaddwd against ones, which adds neighbouring int16 into 8 int32 sums. Per 32-bit
// lane that is one output's 4 k: the [output][4 k] bytes vpdpbusd reads. They come from
// the panel layout (quant_blocks.h: a k's 32 outputs contiguous) by a 4 x 4 byte
// transpose in registers: unpacking rows j, j+1 and j+2, j+3 byte-wise, then the two
// results 16-bit-wise, gives per 128-bit lane 4 outputs x 4 k; one lane swap puts the
// outputs in order. AVX2's unpacks work within 128-bit lanes, so a "half" here is
// outputs 8h..8h+7 with 16+8h..16+8h+7, not AVX-512's 16h..16h+15.
//
// Q4_1: its levels (0-15) are vpmaddubsw's unsigned side, x's levels (|q| <= 127) the
// signed one. A pair's sum is at most 2 * 15 * 127 = 3810, so the int16 sums of a whole
// block (low and high nibbles: 8 pairs an int16) stay under 30,480 and are widened once
// per block. Q8_0's levels are signed: the unsigned side is |q_w| and x takes q_w's sign
// (vpsignb), as llama.cpp does; a pair's sum reaches 2 * 128 * 127 = 32,512, so each
// product is widened at once. The integer sums are exact either way, and the scaling
// that follows is the AVX-512 half's, operation for operation.
//
// Q8_16 (a Q6_K's or Q3_K's levels): int8_avx2_q8_16.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"
#include "reduce.h"

namespace quant::avx2 {

constexpr int kInt8Tile = 4;  // x rows per tile: 2 T int sums + 4 levels + 2 x in 16 registers

// max|v| over n floats (n a multiple of 32): a block's, or a super-block's where x is
// scaled per super-block (int8_rows.h `quantize_rows<8>`).
inline float abs_max(const float* v, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
  return reduce_max8(amax);
}

// One block of 32 floats as levels round-to-even(v * inv) (cvtps rounds to nearest
// even); returns sum(v).
inline float quantize_block(const float* v, float inv, int8_t* q) {
  const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8),
               v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i i01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, scale)),
                                         _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale)));
  const __m256i i23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, scale)),
                                         _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale)));
  // The packs interleave 128-bit lanes: 4-byte groups come out as 0 2 4 6 1 3 5 7.
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  return reduce_add8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
}

// Rows r0..r3 (k = j..j+3) of 32 outputs' bytes as [output][4 k] for half h: outputs
// 8h..8h+7 (`first`) and 16+8h..16+8h+7 (`second`).
inline void transpose4(__m256i r0, __m256i r1, __m256i r2, __m256i r3, int half,
                       __m256i& first, __m256i& second) {
  const __m256i a = half ? _mm256_unpackhi_epi8(r0, r1) : _mm256_unpacklo_epi8(r0, r1);
  const __m256i c = half ? _mm256_unpackhi_epi8(r2, r3) : _mm256_unpacklo_epi8(r2, r3);
  const __m256i v0 = _mm256_unpacklo_epi16(a, c), v1 = _mm256_unpackhi_epi16(a, c);
  first = _mm256_permute2x128_si256(v0, v1, 0x20);
  second = _mm256_permute2x128_si256(v0, v1, 0x31);
}

// Rows j..j+3 of a block's [j][32] bytes, read from memory.
inline void transpose4(const uint8_t* rows, int half, __m256i& first, __m256i& second) {
  const auto row = [&](int i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + i * kPanel));
  };
  transpose4(row(0), row(1), row(2), row(3), half, first, second);
}

// Pins a tile's integer sums to registers where it is called. The sums are exact, so GCC
// is free to regroup their adds, and does: every product of a block first, spilled to
// the stack, summed after. Called after each row's adds, the sums stay in registers.
inline void in_registers(__m256i& a) { asm("" : "+x"(a)); }
inline void in_registers(__m256i& a, __m256i& b) { asm("" : "+x"(a), "+x"(b)); }

inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Lanes [0, n) of 8, as store_out8 in quant_linear.cpp: masked only where needed.
inline void store8(float* p, int64_t n, __m256 v) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
  } else if (n > 0) {
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, lanes, v);
  }
}

// Lanes [0, n) of 8 at p, the rest 0: store8's counterpart.
inline __m256 load8(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  if (n <= 0) return _mm256_setzero_ps();
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Whether half h of a panel with `cols` outputs holds any.
inline bool half_used(int half, int64_t cols) { return cols > 8 * half; }

// T rows of x (levels from row r0) against half `half` of Q4_1 panel p; `cols` of the
// panel's outputs exist. Int8Rows: quant_linear_int8.cpp.
template <int T, typename Rows>
inline void tile_q4_1(const Q4_1& w, int64_t p, int half, const Rows& x, int64_t r0,
                      float* out, int64_t os, int64_t cols) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t blocks = w.K / kBlock;
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = (p * blocks + b) * kPanel;
    const uint8_t* q = w.qs + at * 16;
    const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
    __m256i dot[T][2];
    for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m256i both0, both1;  // k = 4g.. in the low nibbles, k = 16 + 4g.. in the high
      transpose4(q + 4 * g * kPanel, half, both0, both1);
      const __m256i lo0 = _mm256_and_si256(both0, nibble), lo1 = _mm256_and_si256(both1, nibble);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(both0, 4), nibble);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(both1, 4), nibble);
      for (int t = 0; t < T; ++t) {
        const __m256i xl = broadcast4(xq + t * kBlock + 4 * g);
        const __m256i xh = broadcast4(xq + t * kBlock + 4 * g + 16);
        dot[t][0] = _mm256_add_epi16(dot[t][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                 _mm256_maddubs_epi16(hi0, xh)));
        dot[t][1] = _mm256_add_epi16(dot[t][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                 _mm256_maddubs_epi16(hi1, xh)));
        in_registers(dot[t][0], dot[t][1]);
      }
    }
    const float* xd = x.d.data() + b * x.M + r0;
    const float* xsum = x.sum.data() + b * x.M + r0;
    for (int s = 0; s < 2; ++s) {
      const int64_t n0 = 16 * s + 8 * half;
      const __m256 d = _mm256_loadu_ps(w.d + at + n0), m = _mm256_loadu_ps(w.m + at + n0);
      for (int t = 0; t < T; ++t) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[t][s], ones));
        const __m256 scaled = _mm256_mul_ps(sums, _mm256_set1_ps(xd[t]));
        acc[t][s] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[t]),
                                    _mm256_fmadd_ps(scaled, d, acc[t][s]));
      }
    }
  }
  for (int s = 0; s < 2; ++s)
    for (int t = 0; t < T; ++t) {
      const int64_t n0 = 16 * s + 8 * half;
      store8(out + t * os + n0, cols - n0, acc[t][s]);
    }
}

// T rows of x against half `half` of Q8_0 panel p: |q_w| against x with q_w's sign.
template <int T, typename Rows>
inline void tile_q8_0(const Q8_0& w, int64_t p, int half, const Rows& x, int64_t r0,
                      float* out, int64_t os, int64_t cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = w.K / kBlock;
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = (p * blocks + b) * kPanel;
    const uint8_t* q = reinterpret_cast<const uint8_t*>(w.qs + at * kBlock);
    const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;
    __m256i dot[T][2];
    for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m256i w0, w1;
      transpose4(q + 4 * g * kPanel, half, w0, w1);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = broadcast4(xq + t * kBlock + 4 * g);
        dot[t][0] = _mm256_add_epi32(dot[t][0], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0)), ones));
        dot[t][1] = _mm256_add_epi32(dot[t][1], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1)), ones));
        in_registers(dot[t][0], dot[t][1]);
      }
    }
    const float* xd = x.d.data() + b * x.M + r0;
    for (int s = 0; s < 2; ++s) {
      const __m256 d = _mm256_loadu_ps(w.d + at + 16 * s + 8 * half);
      for (int t = 0; t < T; ++t) {
        const __m256 sums = _mm256_cvtepi32_ps(dot[t][s]);
        acc[t][s] = _mm256_fmadd_ps(_mm256_mul_ps(sums, _mm256_set1_ps(xd[t])), d, acc[t][s]);
      }
    }
  }
  for (int s = 0; s < 2; ++s)
    for (int t = 0; t < T; ++t) {
      const int64_t n0 = 16 * s + 8 * half;
      store8(out + t * os + n0, cols - n0, acc[t][s]);
    }
}

}  // namespace quant::avx2
