// The int8 kernels' AVX2 tiles against Q8_16 (a Q6_K's or Q3_K's 6-bit levels,
// q8_16_blocks.h); int8_avx2.h has the shared pieces and the other formats' tiles.
//
// u = level + 32 (0-63) is vpmaddubsw's unsigned side, assembled from the packed bits
// per row of k, against x's signed levels; x's share of the + 32 (32 * sum(q_x) per half
// block of 16 k, one scale) is taken off again, so the sums end exact. A call's one or
// two rows go against the whole panel, from the packed blocks straight, read ahead
// (`tile_q8_16_rows`); more rows, from each panel unpacked once per call into
// [output][4 k] order (`unpack_q8_16_panel`), in tiles whose half blocks are scaled in the
// integers (`tile_q8_16`). Past ~100 rows oneDNN on widened slices is quicker, and the
// routing sends those calls there (gpu/cpu/routing.py `INT8_ONLY_MAX_ROWS`).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "int8_avx2.h"
#include "prefetch.h"
#include "q8_16_blocks.h"
#include "quant_blocks.h"

namespace quant::avx2 {

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

// Q8_16 for calls of more rows: each thread unpacks a panel's blocks once per call
// (`unpack_q8_16_panel`) into a buffer of its own, per block kQ8_16Unpacked bytes of u in
// vpmaddubsw's [output][4 k] order (group j of 4 k, outputs 8v .. 8v + 7 at
// 128 j + 32 v), which every row tile of the panel then reads (`tile_q8_16`).
constexpr int64_t kQ8_16Unpacked = kBlock * kPanel;

inline void unpack_q8_16_panel(const Q8_16& w, int64_t p, uint8_t* panel) {
  constexpr int64_t kReadAhead = 4;
  const int64_t blocks = w.K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = w.global(p, b);
    const uint8_t* q = w.qs + g * Q8_16::kPackedBytes;
    for (int64_t line = 0; line < Q8_16::kPackedBytes; line += 64)
      prefetch::t1(q, kReadAhead * Q8_16::kPackedBytes + line);
    uint8_t* dst = panel + b * kQ8_16Unpacked;
    for (int j = 0; j < 8; ++j) {
      const __m256i u0 = q8_16_row(q, 4 * j), u1 = q8_16_row(q, 4 * j + 1),
                    u2 = q8_16_row(q, 4 * j + 2), u3 = q8_16_row(q, 4 * j + 3);
      __m256i wv[4];  // outputs 0-7, 16-23, 8-15, 24-31
      transpose4(u0, u1, u2, u3, 0, wv[0], wv[1]);
      transpose4(u0, u1, u2, u3, 1, wv[2], wv[3]);
      constexpr int kAt[4] = {0, 2, 1, 3};
      for (int v = 0; v < 4; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 128 * j + 32 * kAt[v]), wv[v]);
    }
  }
}

// The rows a Q8_16 tile takes at most: a group pair's int16 sums (T x 2 vectors) and each
// row's x in the 16 registers, the super-block's int32 sums beside them in memory.
constexpr int kQ8_16Tile = 4;

// T rows of x (levels per super-block, with `Int8Rows.bias16`) against half `half`
// (outputs 16h .. 16h + 15) of Q8_16 panel p unpacked into `panel`. u = level + 32 is at
// most 63, so two groups' products add in int16 (2 * 2 * 63 * 127 = 32,004); vpmaddwd
// then multiplies each sum by its half block's int8 scale code (as `tile_pairs_super`
// does a Q4_K's 6-bit one) into the super-block's int32 sums, and takes x's share of the
// + 32 off there too (32 * code against -sum(q_x), both within int16), so the sums end
// exact, sum(code * level * q_x); they are converted once per super-block and scaled by
// its super and x's scale into `out`.
template <int T, typename Rows>
inline void tile_q8_16(const Q8_16& w, int64_t p, const uint8_t* panel, int half,
                       const Rows& x, int64_t r0, float* out, int64_t os, int64_t cols) {
  const int64_t blocks = w.K / kBlock;
  for (int64_t s0 = 0; s0 < blocks; s0 += kSuperBlocks) {
    __m256i acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int64_t b = s0; b < s0 + kSuperBlocks; ++b) {
      const uint8_t* blk = panel + b * kQ8_16Unpacked + 64 * half;
      const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
      const int64_t g = w.global(p, b);
#pragma GCC unroll 2
      for (int hb = 0; hb < 2; ++hb) {  // half block: k = 16 hb .. 16 hb + 15, one scale
        const int8_t* codes = w.codes + (2 * g + hb) * kPanel + 16 * half;
        const int32_t* bias = x.bias16.data() + (2 * b + hb) * x.M + r0;
        __m256i sc[2];
        for (int v = 0; v < 2; ++v) {
          const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * v));
          sc[v] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c, c));
          const __m256i code32 = _mm256_slli_epi32(_mm256_cvtepi8_epi32(c), 5);  // 32 * code
          for (int t = 0; t < T; ++t)  // bias = -32 * sum(q_x): -sum(q_x) in the low int16
            acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(
                code32, _mm256_set1_epi32(static_cast<uint16_t>(bias[t] >> 5))));
        }
#pragma GCC unroll 2
        for (int pair = 0; pair < 2; ++pair) {
          __m256i dot[T][2];
          for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int i = 0; i < 2; ++i) {
            const int j = 4 * hb + 2 * pair + i;  // group of 4 k
            __m256i xv[T];
            for (int t = 0; t < T; ++t) xv[t] = broadcast4(xq + t * kBlock + 4 * j);
            for (int v = 0; v < 2; ++v) {
              const __m256i u =
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 * j + 32 * v));
              for (int t = 0; t < T; ++t) {
                dot[t][v] = _mm256_add_epi16(dot[t][v], _mm256_maddubs_epi16(u, xv[t]));
                in_registers(dot[t][v]);
              }
            }
          }
          for (int v = 0; v < 2; ++v)
            for (int t = 0; t < T; ++t)
              acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(dot[t][v], sc[v]));
        }
      }
    }
    const float* supers = w.supers + (w.global(p, s0) / kSuperBlocks) * kPanel + 16 * half;
    const float* xd = x.d.data() + s0 * x.M + r0;
    for (int v = 0; v < 2; ++v) {
      const __m256 super = _mm256_loadu_ps(supers + 8 * v);
      const int64_t n0 = 16 * half + 8 * v;
      for (int t = 0; t < T; ++t) {
        float* o = out + t * os + n0;
        const __m256 sums = s0 == 0 ? _mm256_setzero_ps() : load8(o, cols - n0);
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[t][v]), super);
        store8(o, cols - n0, _mm256_fmadd_ps(scaled, _mm256_set1_ps(xd[t]), sums));
      }
    }
  }
}

}  // namespace quant::avx2
