// A Q4_1 weight whose levels are held as the dot-product kernel's pairs
// (quant_linear_bf16.cpp's layout, `PanelBlocks.dot_pairs`) and whose scales are float32
// or a Q4_K's codes (q4_1_scales.h), as the exact kernel (quant_linear.cpp) reads a
// block: the same interface as quant_blocks.h's `Q4_1`, on AVX-512.
//
// Why: a bf16 layer's calls of one to three rows read the pairs. Without AMX its calls of
// more rows took the exact kernel on the panels (quant_blocks.h), so the layer held its
// levels twice, and with float32 scales and mins beside the codes: a Q4_K weight in
// ~1.4 bytes where the file has 0.56. Read from the pairs, those calls give the same
// weights bit for bit, and the panels go.
//
// Widening: per block, chunk c = j / 4 of the pairs is one dword per output n, its high
// word holding k = 4c + i and its low word k = 4c + i + 16 in nibble i = j % 4. Shifted
// right by 16 + 4i (k = j) or 4i (k = j + 16), the nibble sits in bits 0-3, and vpermps,
// which reads only those bits of each index, looks its float up: a shift and a lookup
// per 16 weights, as the panels' `Q4_1::levels` (a zero-extension, a shift and a lookup
// per 32 bytes) costs.
#pragma once

#include <cstdint>

#include "q4_1_scales.h"
#include "quant_blocks.h"

#ifdef __AVX512F__
#include <immintrin.h>

namespace quant {

template <bool kCoded>
struct Q4_1Pairs {
  const uint32_t* qp;  // [panels][K/32][4 chunks][32 outputs]
  Q4_1Scales sc;
  int64_t K;
  static constexpr bool kHalfScales = false;
  static constexpr bool kReadsAhead = false;

  struct Block {
    __m512 d0, d1, m0, m1;
    const uint32_t* q;
  };
  RIDGELINE_INLINE Block block(int64_t p, int64_t b) const {
    Block bl;
    sc.load<kCoded>(p, b, 0, bl.d0, bl.m0);
    sc.load<kCoded>(p, b, 1, bl.d1, bl.m1);
    bl.q = qp + (p * (K / kBlock) + b) * 4 * kPanel;
    return bl;
  }
  // The levels q of weights k = j (lo) and k = j + 16 (hi), outputs 0-15 (0), 16-31 (1).
  static inline void levels(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                            __m512& hi1) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint32_t* q = bl.q + (j / 4) * kPanel;
    const int shift = 4 * (j % 4);
    const __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 16);
    lo0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 16 + shift), values);
    lo1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 16 + shift), values);
    hi0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, shift), values);
    hi1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, shift), values);
  }
  // The weights themselves, d * q + m (one FMA, exact as `Q4_1::widen`).
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    levels(bl, j, lo0, lo1, hi0, hi1);
    Q4_1::scale(bl, lo0, lo1, hi0, hi1);
  }
  static inline void add_block(const Block& bl, __m512 qx0, __m512 qx1, float x_sum,
                               __m512& acc0, __m512& acc1) {
    Q4_1::add_block(bl, qx0, qx1, x_sum, acc0, acc1);
  }
};

}  // namespace quant
#endif
