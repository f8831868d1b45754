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
// Q8_16 (a Q6_K's or Q3_K's 6-bit levels, q8_16_blocks.h): u = level + 32 (0-63) is the
// unsigned side, assembled from the packed bits per row of k; a pair's sum reaches
// 2 * 63 * 127 = 16,002 and is widened at once, and 32 * sum(q_x) per half block (16 k,
// one scale) is taken off again. Rows go two at a time against the whole panel, from the
// packed blocks straight, read ahead (tile_q8_16_rows): a decode call's up to eight,
// where this takes 0.55-0.9x the exact kernel's time; from 16 rows it is slower, and
// the routing keeps those calls exact (gpu/cpu/routing.py `INT8_ONLY_MAX_ROWS`).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "prefetch.h"
#include "q8_16_blocks.h"
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

// Row k (0-31) of a Q8_16 block's levels as u, 32 outputs' bytes: the low 4 bits from
// nibble row k % 16 (its high nibbles where k >= 16), bits 4-5 from top row 16 + k % 8,
// field k / 8 (16-bit shifts: what crosses a byte is masked away).
inline __m256i q8_16_row(const uint8_t* block, int k) {
  const auto row = [&](int i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i * kPanel));
  };
  const __m256i low = k < 16 ? row(k) : _mm256_srli_epi16(row(k - 16), 4);
  const __m256i t = row(16 + k % 8);
  const __m256i high = k < 8    ? _mm256_slli_epi16(t, 4)
                       : k < 16 ? _mm256_slli_epi16(t, 2)
                       : k < 24 ? t
                                : _mm256_srli_epi16(t, 2);
  return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
                         _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}

// The scales (code * super) of half h of Q8_16 block g, outputs 8i .. 8i + 7.
inline __m256 scale8(const Q8_16& w, int64_t g, int h, int i) {
  const __m128i codes =
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.codes + (2 * g + h) * kPanel + 8 * i));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                       _mm256_loadu_ps(w.supers + (g / 8) * kPanel + 8 * i));
}

// 32 * the sum of x's 16 levels at q, in every lane: what u = level + 32 adds.
inline __m256i bias32(const int8_t* q) {
  const __m128i pairs = _mm_maddubs_epi16(
      _mm_set1_epi8(1), _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m128i s4 = _mm_madd_epi16(pairs, _mm_set1_epi16(32));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm256_broadcastd_epi32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
}

// dot += the int32 sums of u (an [output][4 k] vector) against x's 4 levels.
inline __m256i add_products(__m256i dot, __m256i u, __m256i x) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                 _mm256_set1_epi16(1)));
}

// T (1 or 2) rows of x against all of Q8_16 panel p, from its packed blocks: each group
// of 4 k's u assembled in registers and transposed for both halves (vector v: outputs
// 8 * kFirst[v] ..), the blocks kReadAhead ahead asked into L2.
template <int T, typename Rows>
inline void tile_q8_16_rows(const Q8_16& w, int64_t p, const Rows& x, int64_t r0, float* out,
                            int64_t os, int64_t cols) {
  constexpr int kFirst[4] = {0, 2, 1, 3};  // half 0 first, second; half 1 first, second
  constexpr int64_t kReadAhead = 4;
  const int64_t blocks = w.K / kBlock;
  __m256 acc[T][4];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = w.global(p, b);
    const uint8_t* q = w.qs + g * Q8_16::kPackedBytes;
    for (int64_t line = 0; line < Q8_16::kPackedBytes; line += 64)
      prefetch::t1(q, kReadAhead * Q8_16::kPackedBytes + line);
    prefetch::t1(w.codes, (g + kReadAhead) * 2 * kPanel);
    const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d.data() + b * x.M + r0;
    for (int h = 0; h < 2; ++h) {  // k = 16h .. 16h + 15, one scale
      __m256i dot[T][4];
      for (int t = 0; t < T; ++t)
        for (int v = 0; v < 4; ++v) dot[t][v] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        const __m256i u0 = q8_16_row(q, 4 * j), u1 = q8_16_row(q, 4 * j + 1),
                      u2 = q8_16_row(q, 4 * j + 2), u3 = q8_16_row(q, 4 * j + 3);
        __m256i wv[4];
        transpose4(u0, u1, u2, u3, 0, wv[0], wv[1]);
        transpose4(u0, u1, u2, u3, 1, wv[2], wv[3]);
        for (int t = 0; t < T; ++t) {
          const __m256i xv = broadcast4(xq + t * kBlock + 4 * j);
          for (int v = 0; v < 4; ++v) dot[t][v] = add_products(dot[t][v], wv[v], xv);
          in_registers(dot[t][0], dot[t][1]);
          in_registers(dot[t][2], dot[t][3]);
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m256i bias = bias32(xq + t * kBlock + 16 * h);
        const __m256 xdt = _mm256_set1_ps(xd[t]);
        for (int v = 0; v < 4; ++v) {
          const __m256 sums =
              _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[t][v], bias)), xdt);
          acc[t][v] = _mm256_fmadd_ps(sums, scale8(w, g, h, kFirst[v]), acc[t][v]);
        }
      }
    }
  }
  for (int v = 0; v < 4; ++v)
    for (int t = 0; t < T; ++t) {
      const int64_t n0 = 8 * kFirst[v];
      store8(out + t * os + n0, cols - n0, acc[t][v]);
    }
}

}  // namespace quant::avx2
