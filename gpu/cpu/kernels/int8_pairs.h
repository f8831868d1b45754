// x quantized to int8 against a Q4_1 layer held as the bf16 dot kernel's pairs
// (q4_1_pairs.h, `PanelBlocks.dot_pairs`) with float32 scales or a Q4_K's codes
// (q4_1_scales.h), on AVX512-VNNI and AVX2: quant_linear_int8.cpp's algorithm (it has
// the entry point, x's quantization and the rows' tiling) on the layout a bf16 Q4_K
// layer holds where the dot kernel is, so that its prefill's calls need no panels, and
// a layer whose every call is int8 holds (a Q4_K's levels and codes: 0.59 byte a weight
// where the panels with float32 scales take 0.75).
//
// Per block, chunk c of the pairs is a dword per output; its bytes masked to their low
// nibbles hold 4 of the output's levels, to their high nibbles 4 more, each an unsigned
// vpdpbusd operand as it stands. x's levels are quantized in the matching order
// (`kPairOrder`), so each row's 4 bytes are one broadcast dword: one load, a shift and
// two masks per 16 outputs and 8 k, where the panels take a two-register byte gather
// (AVX2: a 4 x 4 byte transpose, int8_avx2.h). AVX2 multiplies the bytes with
// vpmaddubsw into int16 pairs, as its panel tiles do: a block's 8 products per lane of
// levels <= 15 against |q_x| <= 127 stay under 30,480, widened once per block.
#pragma once

#include <cstdint>

#include "force_inline.h"
#include "int8_avx512.h"
#include "q4_1_scales.h"
#include "quant_blocks.h"
#if !(defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) && \
    defined(__AVX2__) && defined(__FMA__)
#include "int8_avx2.h"  // the AVX2 tile below
#endif

namespace quant {

// The order of a block's 32 x levels against a Q4_1 layer held as the dot kernel's pairs
// (q4_1_pairs.h): per chunk c, the bytes `v & 0x0F` of its dwords hold k = 4c + 16,
// 4c + 18, 4c, 4c + 2 and those of `v >> 4 & 0x0F` k = 4c + 17, 4c + 19, 4c + 1, 4c + 3.
constexpr uint8_t kPairOrder[32] = {16, 18, 0, 2, 17, 19, 1, 3, 20, 22, 4, 6, 21, 23, 5, 7,
                                    24, 26, 8, 10, 25, 27, 9, 11, 28, 30, 12, 14, 29, 31, 13, 15};

// A Q4_1 weight held as the dot kernel's pairs ([panels][K/32][4][32] dwords) with its
// scales and mins, float32 or a Q4_K's codes (q4_1_scales.h).
struct Pairs {
  const uint32_t* qp;
  Q4_1Scales sc;
  int64_t K;
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>

namespace int8_pairs {

using int8_avx512::broadcast4;
using int8_avx512::sums_so_far;

// One block's integer sums for T rows (levels from xq, row t at t * 32) against 16
// outputs' pairs q: per chunk one load, its low and high nibbles masked out as bytes.
template <int T>
RIDGELINE_INLINE void block_dots(const uint32_t* q, const int8_t* xq, __m512i (&dot)[T]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < T; ++t) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(q + c * kPanel);
    const __m512i lo = _mm512_and_si512(v, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    for (int t = 0; t < T; ++t) {
      dot[t] = _mm512_dpbusd_epi32(dot[t], lo, broadcast4(xq + t * kBlock + 8 * c));
      dot[t] = _mm512_dpbusd_epi32(dot[t], hi, broadcast4(xq + t * kBlock + 8 * c + 4));
    }
  }
}

// T rows of x (levels in `kPairOrder`) against half `half` of a Q4_1 panel p held as the
// dot kernel's pairs: per chunk one load of 16 outputs' dwords, its low and high nibbles
// masked out as bytes, no gather (the panels' vpermt2b). Scales: float32 per block
// (a Q4_K's codes take `tile_pairs_super`).
template <int T, typename Rows>
inline void tile_pairs(const Pairs& w, int64_t p, int half, const Rows& x,
                       int64_t r0, float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = int8_avx512::half_mask(half, cols);
  const int64_t blocks = w.K / kBlock;
  const bool leads = half == 0 && r0 == 0;  // the span's first tile: reads the next ahead
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = sums_so_far(x, out + t * os + 16 * half, mask);
  for (int64_t b = x.b0; b < x.b1; ++b) {
    const uint32_t* q = w.qp + (p * blocks + b) * 4 * kPanel + 16 * half;
    const int8_t* xq = x.q + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d + b * x.M + r0;
    const float* xsum = x.sum + b * x.M + r0;
    if (leads) w.sc.read_ahead<false>(w.qp, p * blocks + b + int8_avx512::kSpanBlocks);
    __m512i dot[T];
    block_dots<T>(q, xq, dot);
    __m512 d, m;
    w.sc.load<false>(p, b, half, d, m);
    for (int t = 0; t < T; ++t) {
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_set1_ps(xd[t]));
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[t]), _mm512_fmadd_ps(scaled, d, acc[t]));
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os + 16 * half, mask, acc[t]);
}

// The rows a super-block tile takes at most: each super-block's partial sum and each
// block's integer sums per row stay in the 32 registers, the sums so far in memory.
constexpr int kSuperTile = 12;

// As `tile_pairs` for a Q4_K's pairs and codes, x quantized per super-block
// (`quantize_rows<kSuperBlocks>`, as llama.cpp's Q8_K): per block and row its integer
// sums converted and scaled by the block's weight scale into the super-block's partial
// sum, and the mins' term added there with x's exact sum over x's scale (`Int8Rows`); x's
// scale multiplies the partial sum into `out` once per super-block. Per block and row
// three vector operations besides the dot products, where `tile_pairs` takes four (x's
// scale differs per block there), and with the sums so far in memory (a load and a store
// per super-block and row) the registers hold 12 rows, not 8: the block's weights
// unpacked once for more rows. The span's blocks are whole super-blocks (int8_linear's
// spans of 32 blocks, a Q4_K's K a multiple of 256).
template <int T, typename Rows>
inline void tile_pairs_super(const Pairs& w, int64_t p, int half, const Rows& x, int64_t r0,
                             float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = int8_avx512::half_mask(half, cols);
  const int64_t blocks = w.K / kBlock;
  const bool leads = half == 0 && r0 == 0;  // the span's first tile: reads the next ahead
  __m512 part[T];
  bool summed = !x.first;  // whether `out` holds sums of earlier blocks
  for (int64_t b = x.b0; b < x.b1; ++b) {
    const uint32_t* q = w.qp + (p * blocks + b) * 4 * kPanel + 16 * half;
    const int8_t* xq = x.q + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xsum = x.sum + b * x.M + r0;
    if (leads) w.sc.read_ahead<true>(w.qp, p * blocks + b + int8_avx512::kSpanBlocks);
    __m512i dot[T];
    block_dots<T>(q, xq, dot);
    __m512 d, m;
    w.sc.load<true>(p, b, half, d, m);
    const bool opens = b % kSuperBlocks == 0;
    for (int t = 0; t < T; ++t) {
      const __m512 scaled = _mm512_cvtepi32_ps(dot[t]);
      part[t] = opens ? _mm512_mul_ps(scaled, d) : _mm512_fmadd_ps(scaled, d, part[t]);
      part[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[t]), part[t]);
    }
    if (b % kSuperBlocks == kSuperBlocks - 1)
      int8_avx512::add_super_block<T>(part, x, b, r0, out + 16 * half, os, mask, summed);
  }
}
}  // namespace int8_pairs
#elif defined(__AVX2__) && defined(__FMA__)
namespace int8_pairs {

// One block's int16 sums for T rows (levels from xq, row t at t * 32) against V vectors
// of 8 outputs' pairs at q: per chunk and vector one load, its low or high nibbles masked
// out as bytes, each row's 4 levels broadcast once for every vector.
template <int T, int V>
RIDGELINE_INLINE void block_dots(const uint32_t* q, const int8_t* xq, __m256i (&dot)[T][V]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) dot[t][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // chunk i / 2, its low nibbles (i even) or high ones
    __m256i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = avx2::broadcast4(xq + t * kBlock + 4 * i);
    for (int v = 0; v < V; ++v) {
      __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i / 2 * kPanel) + v);
      if (i % 2) wv = _mm256_srli_epi16(wv, 4);
      wv = _mm256_and_si256(wv, nibble);
      for (int t = 0; t < T; ++t) {
        dot[t][v] = _mm256_add_epi16(dot[t][v], _mm256_maddubs_epi16(wv, xv[t]));
        avx2::in_registers(dot[t][v]);
      }
    }
  }
}

// As the AVX-512 tile, in vectors of 8 outputs. Up to two rows (decode) take the whole
// panel in one pass (4 vectors; the call for half 1 does nothing), so that each block's
// 512 bytes are read once, in order: per half, a pass reads every other 64 bytes, and a
// decode step that streams its weights from memory reads them markedly slower so. More
// rows take half a panel (2 vectors) per pass, for the registers.
template <int T, typename Rows>
inline void tile_pairs(const Pairs& w, int64_t p, int half, const Rows& x,
                       int64_t r0, float* out, int64_t os, int64_t cols) {
  constexpr int V = T <= 2 ? 4 : 2;
  constexpr int64_t kReadAhead = 4;
  if (V == 4 && half) return;
  const int64_t n_first = V == 4 ? 0 : 16 * half;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = w.K / kBlock;
  __m256 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* q = w.qp + (p * blocks + b) * 4 * kPanel + n_first;
    if (V == 4) w.sc.read_ahead<false>(w.qp, p * blocks + b + kReadAhead);
    const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d.data() + b * x.M + r0;
    const float* xsum = x.sum.data() + b * x.M + r0;
    __m256i dot[T][V];
    block_dots<T, V>(q, xq, dot);
    for (int v = 0; v < V; ++v) {
      __m256 d, m;
      w.sc.load8<false>(p, b, n_first + 8 * v, d, m);
      for (int t = 0; t < T; ++t) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[t][v], ones));
        const __m256 scaled = _mm256_mul_ps(sums, _mm256_set1_ps(xd[t]));
        acc[t][v] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[t]),
                                    _mm256_fmadd_ps(scaled, d, acc[t][v]));
      }
    }
  }
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < T; ++t) {
      const int64_t n0 = n_first + 8 * v;
      avx2::store8(out + t * os + n0, cols - n0, acc[t][v]);
    }
}

// The int16 pairs of each dword the 6-bit code of output n0 + j (j = 0..7) at c:
// vpmaddwd's multiplier for both of the output's int16 sums.
inline __m256i code_pairs(const uint8_t* c) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b));
}

// The rows a super-block tile takes at most: a block's int16 sums (T x 2 vectors) and
// each row's x in the 16 registers, the super-block's int32 sums beside them in memory.
constexpr int kSuperTile = 4;

// As `tile_pairs` for a Q4_K's pairs and codes, x quantized per super-block
// (`quantize_rows<kSuperBlocks>`, as llama.cpp's Q8_K). vpmaddwd, which widens a block's
// int16 sums anyway, multiplies them by each output's 6-bit scale code where the other
// tiles multiply by ones, so a block is scaled in the integers and its sums added into
// the super-block's int32 sums, converted once a super-block (as llama.cpp's AVX2 Q4_K
// dot product does): per block and row two integer operations besides the dot products,
// where `tile_pairs` takes four in float and the widening. The mins' term (each
// block's min times x's exact sum over x's scale) and the super-block's d are applied
// in float as it closes, and x's scale multiplies the result into `out` there. The
// int32 sums cannot overflow: a block's int16 sums are at most 8 * 2 * 15 * 127 = 30,480,
// a scaled pair's 2 * 30,480 * 63, eight blocks' 31 million.
template <int T, typename Rows>
inline void tile_pairs_super(const Pairs& w, int64_t p, int half, const Rows& x, int64_t r0,
                             float* out, int64_t os, int64_t cols) {
  constexpr int V = T <= 2 ? 4 : 2;  // vectors of 8 outputs a pass, as `tile_pairs`
  constexpr int64_t kReadAhead = 4;
  if (V == 4 && half) return;
  const int64_t n_first = V == 4 ? 0 : 16 * half;
  const int64_t blocks = w.K / kBlock;
  for (int64_t s0 = 0; s0 < blocks; s0 += kSuperBlocks) {
    __m256i acc[T][V];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_si256();
    for (int64_t b = s0; b < s0 + kSuperBlocks; ++b) {
      const uint32_t* q = w.qp + (p * blocks + b) * 4 * kPanel + n_first;
      if (V == 4) w.sc.read_ahead<true>(w.qp, p * blocks + b + kReadAhead);
      const int8_t* xq = x.q.data() + (b * x.M + r0) * kBlock;  // row t at t * 32
      __m256i dot[T][V];
      block_dots<T, V>(q, xq, dot);
      const uint8_t* codes = w.sc.codes + (p * blocks + b) * 2 * kPanel + n_first;
      for (int v = 0; v < V; ++v) {
        const __m256i scale = code_pairs(codes + 8 * v);
        for (int t = 0; t < T; ++t)
          acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(dot[t][v], scale));
      }
    }
    const uint8_t* mins = w.sc.codes + (p * blocks + s0) * 2 * kPanel + kPanel + n_first;
    const float* supers = w.sc.supers + (p * (blocks / kSuperBlocks) + s0 / kSuperBlocks) *
                          2 * kPanel + n_first;  // d, then -dmin
    const float* xd = x.d.data() + s0 * x.M + r0;
    for (int v = 0; v < V; ++v) {
      const __m256 dmin = _mm256_loadu_ps(supers + kPanel + 8 * v);
      __m256 part[T];
      for (int t = 0; t < T; ++t) part[t] = _mm256_setzero_ps();
      for (int64_t j = 0; j < kSuperBlocks; ++j) {
        const __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + j * 2 * kPanel + 8 * v)))));
        const float* xsum = x.sum.data() + (s0 + j) * x.M + r0;
        for (int t = 0; t < T; ++t) part[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[t]), part[t]);
      }
      const __m256 d = _mm256_loadu_ps(supers + 8 * v);
      const int64_t n0 = n_first + 8 * v;
      for (int t = 0; t < T; ++t) {
        part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][v]), d, part[t]);
        float* o = out + t * os + n0;
        const __m256 sums = s0 == 0 ? _mm256_setzero_ps() : avx2::load8(o, cols - n0);
        avx2::store8(o, cols - n0, _mm256_fmadd_ps(part[t], _mm256_set1_ps(xd[t]), sums));
      }
    }
  }
}

}  // namespace int8_pairs
#endif

}  // namespace quant
