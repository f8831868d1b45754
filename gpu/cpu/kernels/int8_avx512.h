// The AVX512-VNNI int8 kernels' shared pieces (quant_linear_int8.cpp has the algorithm
// and the entry points): a half panel's lanes, the byte gather from a block's [k][32]
// rows to vpdpbusd's [output][4 k], a row's 4 x levels broadcast; and the tile for
// Q8_16 (a Q6_K's or Q3_K's levels, q8_16_blocks.h), with the panel's unpacking for it.
//
// Q8_16: per panel its blocks' 6-bit levels are unpacked once into a thread's buffer,
// already in vpdpbusd's [output][4 k] order with the block's scales beside them, which
// every row tile of the panel then reads: the levels stored + 32 (unsigned) against x's
// signed levels, the integer sums exact per half block (16 k) once x's share of the + 32
// is taken off (it starts them), each converted and scaled by its own scale (code *
// super) once.
#pragma once

#include <cstdint>
#include <cstring>

#include "force_inline.h"
#include "prefetch.h"
#include "q8_16_blocks.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>

namespace quant::int8_avx512 {

// Per panel, a call's blocks go in spans of kSpanBlocks (1024 k), each span's half panel
// read by every row tile in turn: a few KB (a Q4_K's pairs; a Q8_16's unpacked ~20 KB)
// that stay in L1 across the tiles, where a whole half panel of a long K (an MLP's down
// projection: K = 8192 or more) would not, and every tile would stream it from L2 again.
// While a span's tiles run, its first tile asks L2 for the next span's weights (one span
// on in memory order: the panel's next blocks, or the next panel's first), so that the
// weights stream from memory under the tiles' arithmetic rather than between it: a
// decode step of a few sequences reads a 4 GB model's weights from memory at every step.
constexpr int64_t kSpanBlocks = 32;

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

// A tile's sums so far: zero where its span of blocks starts them, else what `out` holds
// (int8_rows.h `Int8Span`).
template <typename Span>
inline __m512 sums_so_far(const Span& x, const float* out, __mmask16 mask) {
  return x.first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out);
}

inline __m512i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// Q8_16 for the int8 tiles: each thread unpacks a panel's span of blocks once
// (`unpack_q8_16_panel`, before the span's first tile) into a buffer of its own (a span's,
// ~40 KB), per block `Q8_16Panel::kBytes`: the levels as vpdpbusd reads them, [8 groups
// of 4 k][32 outputs][4 k], stored as level + 32 (0-63: the unsigned operand, x's levels
// the signed one), so that a tile loads each group's 16 outputs with one load; then per
// half of the panel (16 outputs) the scales of k 0-15 and 16-31 (code * super, float32).
struct Q8_16Panel {
  static constexpr int64_t kLevels = kBlock * kPanel;
  static constexpr int64_t kBytes = kLevels + 2 * 2 * 64;
};

// Blocks [b0, b1) of panel p; the next span's levels asked of L2 meanwhile (codes and
// supers are a few lines a span: the hardware's prefetch keeps up with them).
inline void unpack_q8_16_panel(const Q8_16& w, int64_t p, int64_t b0, int64_t b1,
                               int8_t* panel) {
  const __m512i index[2] = {gather_index(0), gather_index(1)};
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t g = w.global(p, b);
    int8_t* dst = panel + (b - b0) * Q8_16Panel::kBytes;
    const int64_t ahead = g + kSpanBlocks;  // past the layer's last block: harmless
    for (int64_t line = 0; line < Q8_16::kPackedBytes / 64; ++line)
      prefetch::t1(w.qs, ahead * Q8_16::kPackedBytes + 64 * line);
    __m512i even;  // rows 4j, 4j + 1 until rows 4j + 2, 4j + 3 come
    Q8_16::unpack_steps<false>(w.qs + g * Q8_16::kPackedBytes, [&](int v, __m512i rows) {
      if (v % 2 == 0) {
        even = rows;
        return;
      }
      const int j = v / 2;  // rows 4j .. 4j + 3 in registers: `gather_group`'s bytes
      for (int half = 0; half < 2; ++half)
        _mm512_store_si512(dst + j * 2 * 64 + half * 64,
                           _mm512_permutex2var_epi8(even, index[half], rows));
    });
    for (int half = 0; half < 2; ++half) {
      const float* supers = w.supers + (g / 8) * kPanel + 16 * half;
      float* f = reinterpret_cast<float*>(dst + Q8_16Panel::kLevels + half * 2 * 64);
      const int8_t* codes = w.codes + 2 * g * kPanel + 16 * half;  // k 0-15, then 16-31
      _mm512_store_ps(f, Q8_16::scales16(codes, supers));
      _mm512_store_ps(f + 16, Q8_16::scales16(codes + kPanel, supers));
    }
  }
}

// Closes the super-block that ends at block b for T rows of a K-quant tile: each row's
// partial sum times x's scale (each block's `d` is its super-block's) into `out` (the
// half's first output, row stride os), added to what it holds where `summed` (sums of
// earlier super-blocks), else written; then `summed`.
template <int T, typename Rows>
RIDGELINE_INLINE void add_super_block(const __m512 (&part)[T], const Rows& x, int64_t b,
                                      int64_t r0, float* out, int64_t os, __mmask16 mask,
                                      bool& summed) {
  const float* xd = x.d + b * x.M + r0;
  for (int t = 0; t < T; ++t) {
    float* o = out + t * os;
    const __m512 sums = summed ? _mm512_maskz_loadu_ps(mask, o) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(o, mask, _mm512_fmadd_ps(part[t], _mm512_set1_ps(xd[t]), sums));
  }
  summed = true;
}

// The rows a Q8_16 tile takes at most: per row its integer sums of the block's half and
// its super-block's partial sum stay in registers, the sums so far in memory.
constexpr int kQ8_16Tile = 12;

// T rows of x (levels from row r0, per super-block, with `Int8Rows.bias16`) against half
// `half` of a Q8_16 panel unpacked by `unpack_q8_16_panel` into `panel`. Per half block
// and row: the integer sums start at x's bias (-32 * the sum of its 16 levels: what the
// weights' + 32 adds), so they end exact, sum(level * q_x); each is converted and scaled
// by its own scale into the super-block's partial sum, which x's scale multiplies into
// `out` once. Per half block and row two vector operations besides the four dot
// products (the bias is a load).
template <int T, typename Rows>
inline void tile_q8_16(const int8_t* panel, int half, const Rows& x, int64_t r0,
                       float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = half_mask(half, cols);
  __m512 part[T];
  bool summed = !x.first;  // whether `out` holds sums of earlier blocks
  for (int64_t b = x.b0; b < x.b1; ++b) {
    const int8_t* blk = panel + (b - x.b0) * Q8_16Panel::kBytes;
    const float* f = reinterpret_cast<const float*>(blk + Q8_16Panel::kLevels + half * 2 * 64);
    const int8_t* xq = x.q + (b * x.M + r0) * kBlock;  // row t at t * 32
    if (b % kSuperBlocks == 0)
      for (int t = 0; t < T; ++t) part[t] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // k = 16h .. 16h + 15
      const int32_t* bias = x.bias16 + (2 * b + h) * x.M + r0;
      __m512i dot[T];
      for (int t = 0; t < T; ++t) dot[t] = _mm512_set1_epi32(bias[t]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {  // group j of 4 k (fully unrolled: the sums in registers)
        const int j = 4 * h + i;
        const __m512i lv = _mm512_load_si512(blk + j * 2 * 64 + half * 64);
        for (int t = 0; t < T; ++t)
          dot[t] = _mm512_dpbusd_epi32(dot[t], lv, broadcast4(xq + t * kBlock + 4 * j));
      }
      const __m512 scale = _mm512_load_ps(f + 16 * h);
      for (int t = 0; t < T; ++t)
        part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale, part[t]);
    }
    if (b % kSuperBlocks == kSuperBlocks - 1)
      add_super_block<T>(part, x, b, r0, out + 16 * half, os, mask, summed);
  }
}

}  // namespace quant::int8_avx512
#endif
