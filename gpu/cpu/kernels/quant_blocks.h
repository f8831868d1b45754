// The block formats the CPU quant kernels read (quant_linear.cpp): Q4_1 and Q8_0 (the
// third, Q8_16: q8_16_blocks.h), every GGUF type the kernels serve rewritten into one of
// them by gguf_repack.cpp, in panels, each able to give a weight (portable code) or, on
// AVX-512, a block's 32 x 32 levels or weights in registers (on AVX2: 8 outputs of them,
// one 8-lane register per k).
//
// Layout: panels of kPanel = 32 output rows (gpu/cpu/panel_blocks.py repacks the row
// order at load; N is padded to whole panels with zero blocks). Per panel p and block
// b (32 k): Q4_1 qweight[p][b][j][n] (uint8, j < 16) holds weight k = 32b + j of
// output 32p + n in its low nibble and k = 32b + j + 16 in its high one (GGML's pairing,
// transposed); Q8_0 qweight[p][b][j][n] (int8, j < 32) holds k = 32b + j; scales (and
// Q4_1's mins) [p][b][n], fp32. So one 32-byte load gives a k's weights for 32 outputs:
// the kernel is an outer product, outputs along the vector lanes, with no horizontal
// sums (the previous layout, one output's blocks in a row, needed them).
//
// Exactness: every weight is dequantized exactly as gguf-py's numpy dequantizer does
// it in float32 — Q4_1 `(d * q) + m` (a multiply, then an add), Q8_0 `q * d` — so the
// served fp32 weights and these agree bit for bit, and the results differ from an fp32
// matmul only by summation order. Q4_1 widens with one fused multiply-add all the same:
// d and m are f16 values in a GGUF (11 significant bits), so d * q (q < 16) is exact in
// fp32 and only the add rounds, in both. That holds only for f16 scales, so PanelBlocks
// refuses others (gpu/cpu/panel_blocks.py). One instruction fewer per 16 weights, where
// few rows are bound by those instructions. quant_linear.cpp's few-row path sums
// q * x per block and scales once, d * sum(q x) + m * sum(x): the same sum regrouped,
// which rounds differently at the level of fp32's epsilon, as a change of summation
// order does. With x = identity it still gives every weight bit for bit (d * q is
// exact, then one rounding for + m), which the tests check.
//
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "force_inline.h"
#include "prefetch.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace quant {

constexpr int64_t kBlock = 32;  // weights per block (every format; Q8_16 scales halves)
constexpr int64_t kPanel = 32;  // output rows per panel: two 16-lane vectors
// A K-quant's super-blocks hold 8 blocks of 32 k; the int8 kernels quantize x per
// super-block against them (one scale per 256 k, as llama.cpp's Q8_K), so that a tile
// multiplies by x's scale once per super-block.
constexpr int64_t kSuperBlocks = 8;
// The exact kernels' paths (quant_linear.cpp says why): scales applied per block, not
// per weight, up to kPerBlockMaxRows x rows; above, weights widened per chunk of kChunk
// k into an L1 buffer (128 x 32 floats = 16 KB).
constexpr int kPerBlockMaxRows = 4;
constexpr int64_t kChunk = 128;

// Each row's sum of x over each block of k (sums[t * blocks + b]): the per-block path
// adds m * sum(x) once per block instead of m per weight.
inline std::vector<float> block_sums(const float* x, int64_t M, int64_t xs, int64_t blocks) {
  std::vector<float> sums(M * blocks);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      float sum = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) sum += x[t * xs + b * kBlock + j];
      sums[t * blocks + b] = sum;
    }
  return sums;
}

// One Q4_1 weight matrix in panels. `weight` (portable) or `block` with `levels`,
// `widen` and `add_block` (AVX-512).
struct Q4_1 {
  const uint8_t* qs;
  const float* d;
  const float* m;
  int64_t K;
  static constexpr bool kHalfScales = false;  // one scale per block (Q8_16 has two)

  float weight(int64_t p, int64_t k, int64_t n) const {
    const int64_t b = k / kBlock, j = k % kBlock, at = (p * (K / kBlock) + b) * kPanel + n;
    const uint8_t q = qs[((p * (K / kBlock) + b) * 16 + j % 16) * kPanel + n];
    const float scaled = d[at] * static_cast<float>(j < 16 ? q & 0x0F : q >> 4);
    return scaled + m[at];
  }

#ifdef __AVX512F__
  struct Block {
    __m512 d0, d1, m0, m1;
    const uint8_t* q;
  };
  // No read-ahead (Q8_0's): a bf16 model's one-row Q4_1 calls take quant_linear_bf16,
  // which reads ahead itself; fp32 models' calls here were not measured with one.
  static constexpr bool kReadsAhead = false;
  RIDGELINE_INLINE Block block(int64_t p, int64_t b) const {
    const int64_t at = (p * (K / kBlock) + b) * kPanel;
    return {_mm512_loadu_ps(d + at), _mm512_loadu_ps(d + at + 16), _mm512_loadu_ps(m + at),
            _mm512_loadu_ps(m + at + 16), qs + at * 16};
  }
  // The levels q of weights k = j (lo) and k = j + 16 (hi) of the block, as floats,
  // outputs 0-15 (0) and 16-31 (1). float(q) comes from a 16-entry table: vpermps reads
  // only the low 4 bits of each index, so the low nibble needs no mask, and the lookup
  // replaces the int-to-float convert. Two instructions fewer per 64 weights than
  // mask-and-convert, which counts where few rows are bound by the widening.
  static inline void levels(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                            __m512& hi1) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* q = bl.q + j * kPanel;
    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i q1 =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    lo0 = _mm512_permutexvar_ps(q0, values);
    lo1 = _mm512_permutexvar_ps(q1, values);
    hi0 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), values);
    hi1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), values);
  }
  // The weights themselves, d * q + m.
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    levels(bl, j, lo0, lo1, hi0, hi1);
    scale(bl, lo0, lo1, hi0, hi1);
  }
  // Levels to weights, d * q + m, for any block with Q4_1's scales (q4_1_pairs.h too).
  template <typename B>
  static inline void scale(const B& bl, __m512& lo0, __m512& lo1, __m512& hi0, __m512& hi1) {
    lo0 = _mm512_fmadd_ps(lo0, bl.d0, bl.m0);
    lo1 = _mm512_fmadd_ps(lo1, bl.d1, bl.m1);
    hi0 = _mm512_fmadd_ps(hi0, bl.d0, bl.m0);
    hi1 = _mm512_fmadd_ps(hi1, bl.d1, bl.m1);
  }
  // acc += d * (the block's sum of q * x) + m * (the block's sum of x).
  template <typename B>
  static inline void add_block(const B& bl, __m512 qx0, __m512 qx1, float x_sum,
                               __m512& acc0, __m512& acc1) {
    const __m512 xs = _mm512_set1_ps(x_sum);
    acc0 = _mm512_fmadd_ps(bl.m0, xs, _mm512_fmadd_ps(bl.d0, qx0, acc0));
    acc1 = _mm512_fmadd_ps(bl.m1, xs, _mm512_fmadd_ps(bl.d1, qx1, acc1));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // Eight outputs of a block at a time: group g (outputs 8g .. 8g+7) of panel p, block b.
  // `at` is the block's first scale, `q` its first level byte (see `at` and `levels_at`).
  inline int64_t at(int64_t p, int64_t b) const { return (p * (K / kBlock) + b) * kPanel; }
  inline const uint8_t* levels_at(int64_t p, int64_t b) const { return qs + at(p, b) * 16; }
  static constexpr int64_t kLevelBytes = 16 * kPanel;  // one block's levels, a panel's outputs
  // The levels q of weights k = j (lo) and k = j + 16 (hi) of outputs 8g .. 8g+7.
  static inline void levels8(const uint8_t* q, int j, int g, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * kPanel + 8 * g)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  // The weights themselves, d * q + m (one FMA: d * q is exact, see above).
  inline void widen8(const uint8_t* q, int64_t at, int j, int g, __m256& lo, __m256& hi) const {
    levels8(q, j, g, lo, hi);
    const __m256 dv = _mm256_loadu_ps(d + at + 8 * g), mv = _mm256_loadu_ps(m + at + 8 * g);
    lo = _mm256_fmadd_ps(lo, dv, mv);
    hi = _mm256_fmadd_ps(hi, dv, mv);
  }
  // acc + d * (the block's sum of q * x: its halves lo + hi) + m * (the block's sum of
  // x), outputs of group g.
  inline __m256 add_block8(int64_t at, int g, __m256 lo, __m256 hi, float x_sum,
                           __m256 acc) const {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(d + at + 8 * g), _mm256_add_ps(lo, hi), acc);
    return _mm256_fmadd_ps(_mm256_loadu_ps(m + at + 8 * g), _mm256_set1_ps(x_sum), acc);
  }
#endif
};

// One Q8_0 weight matrix in panels.
struct Q8_0 {
  const int8_t* qs;
  const float* d;
  int64_t K;
  static constexpr bool kHalfScales = false;

  float weight(int64_t p, int64_t k, int64_t n) const {
    const int64_t b = k / kBlock, j = k % kBlock;
    return static_cast<float>(qs[((p * (K / kBlock) + b) * kBlock + j) * kPanel + n]) *
           d[(p * (K / kBlock) + b) * kPanel + n];
  }

#ifdef __AVX512F__
  struct Block {
    __m512 d0, d1;
    const int8_t* q;
    const float* d;
  };
  RIDGELINE_INLINE Block block(int64_t p, int64_t b) const {
    const int64_t at = (p * (K / kBlock) + b) * kPanel;
    return {_mm512_loadu_ps(d + at), _mm512_loadu_ps(d + at + 16), qs + at * kBlock, d + at};
  }
  // Read ahead (quant_linear.cpp's per-block path): line j of the levels kReadAhead
  // blocks past this one, and with j < 2 line j of their scales, into L2. A thread's
  // panels are one run of blocks in both streams, so the lines ahead are the ones it
  // reads next (past its last block they are other memory or none: a prefetch never
  // faults, prefetch.h forms the addresses as integers).
  static constexpr bool kReadsAhead = true;
  static constexpr int64_t kReadAhead = 8;  // blocks (8 KB of levels)
  static inline void read_ahead(const Block& bl, int j) {
    prefetch::t1(bl.q, kReadAhead * kBlock * kPanel + 64 * j);
    if (j < 2) prefetch::t1(bl.d, kReadAhead * kPanel * 4 + 64 * j);
  }
  static inline __m512 level(const int8_t* q) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  }
  static inline void levels(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                            __m512& hi1) {
    lo0 = level(bl.q + j * kPanel);
    lo1 = level(bl.q + j * kPanel + 16);
    hi0 = level(bl.q + (j + 16) * kPanel);
    hi1 = level(bl.q + (j + 16) * kPanel + 16);
  }
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    levels(bl, j, lo0, lo1, hi0, hi1);
    lo0 = _mm512_mul_ps(lo0, bl.d0);
    lo1 = _mm512_mul_ps(lo1, bl.d1);
    hi0 = _mm512_mul_ps(hi0, bl.d0);
    hi1 = _mm512_mul_ps(hi1, bl.d1);
  }
  static inline void add_block(const Block& bl, __m512 qx0, __m512 qx1, float /*x_sum*/,
                               __m512& acc0, __m512& acc1) {
    acc0 = _mm512_fmadd_ps(bl.d0, qx0, acc0);
    acc1 = _mm512_fmadd_ps(bl.d1, qx1, acc1);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  inline int64_t at(int64_t p, int64_t b) const { return (p * (K / kBlock) + b) * kPanel; }
  inline const int8_t* levels_at(int64_t p, int64_t b) const { return qs + at(p, b) * kBlock; }
  static constexpr int64_t kLevelBytes = kBlock * kPanel;
  static inline __m256 level8(const int8_t* q) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  static inline void levels8(const int8_t* q, int j, int g, __m256& lo, __m256& hi) {
    lo = level8(q + j * kPanel + 8 * g);
    hi = level8(q + (j + 16) * kPanel + 8 * g);
  }
  inline void widen8(const int8_t* q, int64_t at, int j, int g, __m256& lo, __m256& hi) const {
    levels8(q, j, g, lo, hi);
    const __m256 dv = _mm256_loadu_ps(d + at + 8 * g);
    lo = _mm256_mul_ps(lo, dv);
    hi = _mm256_mul_ps(hi, dv);
  }
  inline __m256 add_block8(int64_t at, int g, __m256 lo, __m256 hi, float /*x_sum*/,
                           __m256 acc) const {
    return _mm256_fmadd_ps(_mm256_loadu_ps(d + at + 8 * g), _mm256_add_ps(lo, hi), acc);
  }
#endif
};

#ifdef __AVX512F__
constexpr int64_t kTile = 12;  // x rows per micro-kernel at most (with_rows dispatches)

// Lane masks for the panel's two vectors when only `cols` of its 32 outputs exist.
inline void column_masks(int64_t cols, __mmask16& m0, __mmask16& m1) {
  m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
}

#ifdef __AVX512BF16__
// T rows of a panel's float32 sums (outputs 0-15, 16-31) rounded to bf16 (vcvtneps2bf16,
// to nearest even) into `out` (row stride os), `cols` of the 32 outputs real: the bf16
// dot-product kernels' store.
template <int T>
inline void store_bf16_panel(const __m512 (&acc)[T][2], c10::BFloat16* out, int64_t os,
                             int64_t cols) {
  __mmask16 k0, k1;
  column_masks(cols, k0, k1);
  for (int t = 0; t < T; ++t) {
    auto* o = reinterpret_cast<uint16_t*>(out + t * os);
    _mm256_mask_storeu_epi16(o, k0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[t][0])));
    _mm256_mask_storeu_epi16(o + 16, k1,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[t][1])));
  }
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
// 16 registers of 8 lanes: 6 rows x 16 outputs of accumulators, as BLAS's AVX2 kernels.
constexpr int64_t kTile = 6;
#else
constexpr int64_t kTile = 1;  // portable code: no micro-kernels
#endif

// Dispatch on a row count (1..Max; more take Max) so each micro-kernel's loops have
// constant bounds (fully unrolled, accumulators in registers).
template <int Max = static_cast<int>(kTile), typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, std::forward<Fn>(fn));
  }
  fn(std::integral_constant<int, Max>{});
}

}  // namespace quant
