// The Q8_16 block format the CPU quant kernels read (quant_linear.cpp, the AMX and unpack
// kernels): GGUF's Q6_K and Q3_K (models/gguf_repack.py), int8 levels in [-32, 31] with a
// scale per 16 weights, in quant_blocks.h's panels of 32 outputs, the levels packed to 6
// bits and each scale kept as the file keeps it: an int8 code times a float32 scale per
// 256 k (the super-block's).
//
// Layout, per panel p and block b (32 k), g = p * K/32 + b its index in memory order:
//   qs[g]: 768 bytes, with u = level + 32 (0..63): 16 rows of 32 bytes, byte [j][n] the
//     low 4 bits of u for k = 32b + j (bits 0-3) and k = 32b + j + 16 (bits 4-7) of output
//     32p + n (Q4_1's pairing); then 8 rows, byte [i][n] the top 2 bits of u for
//     k = 32b + i + 8f at bits 2f (f < 4);
//   codes[2g + h][n]: int8, and supers[g / 8][n]: float32, the scale of k = 32b + 16h + i
//     being codes * supers (g / 8 counts super-blocks: a K-quant's K is a multiple of 256).
// gguf_repack.cpp (`pack6`) writes it from the file.
//
// Why: the file's bytes, 0.83 a weight (a Q6_K's 0.82), where int8 levels and float32
// scales took 1.25; a Q4_K_M's Q6_K layers and LM head are about a quarter of its weights.
// The price is unpacking: each kernel reads a block whole, so on AVX-512 `block` unpacks
// its levels once into 1 KB of L1 (five vector instructions per 64 levels) and the
// kernels read them from there as Q8_0's; AVX2 unpacks eight outputs at a time in
// registers.
//
// Exactness: code * super is an f16 value times a small integer, exact in float32, and a
// weight is that scale times the level, as gguf-py computes it: bit for bit the same.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "quant_blocks.h"

namespace quant {

struct Q8_16 {
  const uint8_t* qs;
  const int8_t* codes;
  const float* supers;
  int64_t K;
  static constexpr bool kHalfScales = true;           // a scale per 16 k: two per block
  static constexpr int64_t kPackedBytes = 24 * kPanel;  // a block's levels

  // The kernels' three tensors (`PanelBlocks.tensors`), checked: levels uint8
  // [P, K/32, 24, 32], codes int8 [P, K/16, 32], supers float32 [P, K/256, 32].
  static Q8_16 of(const at::Tensor& levels, const at::Tensor& codes, const at::Tensor& supers,
                  const char* op) {
    TORCH_CHECK(levels.scalar_type() == at::kByte && levels.dim() == 4 &&
                    levels.is_contiguous() && levels.size(2) == 24 && levels.size(3) == kPanel,
                op, ": levels must be contiguous uint8 [panels, K/32, 24, 32], got ",
                levels.scalar_type(), " ", levels.sizes());
    const int64_t P = levels.size(0), K = levels.size(1) * kBlock;
    TORCH_CHECK(K % 256 == 0 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                    codes.sizes() == at::IntArrayRef({P, K / 16, kPanel}) &&
                    supers.scalar_type() == at::kFloat && supers.is_contiguous() &&
                    supers.sizes() == at::IntArrayRef({P, K / 256, kPanel}),
                op, ": codes must be contiguous int8 [", P, ", ", K / 16, ", 32] and supers "
                "float32 [", P, ", ", K / 256, ", 32], got ", codes.scalar_type(), " ",
                codes.sizes(), " and ", supers.scalar_type(), " ", supers.sizes());
    return {levels.const_data_ptr<uint8_t>(), codes.const_data_ptr<int8_t>(),
            supers.const_data_ptr<float>(), K};
  }

  int64_t global(int64_t p, int64_t b) const { return p * (K / kBlock) + b; }

  float weight(int64_t p, int64_t k, int64_t n) const {
    const int64_t g = global(p, k / kBlock);
    const int j = static_cast<int>(k % kBlock);
    const uint8_t* q = qs + g * kPackedBytes;
    const int low = (q[(j % 16) * kPanel + n] >> (4 * (j / 16))) & 0x0F;
    const int high = (q[(16 + j % 8) * kPanel + n] >> (2 * (j / 8))) & 3;
    const float scale = static_cast<float>(codes[(2 * g + j / 16) * kPanel + n]) *
                        supers[(g / 8) * kPanel + n];
    return scale * static_cast<float>((low | (high << 4)) - 32);
  }

#ifdef __AVX512F__
  struct Block {
    __m512 d0, d1, e0, e1;  // scales of k = j (d) and k = j + 16 (e), outputs 0-15, 16-31
    const uint8_t* packed;  // the block in memory, for the read-ahead
    const int8_t* codes;
    const float* supers;
    alignas(64) int8_t q[kBlock * kPanel];  // the levels unpacked: Q8_0's layout
  };

  // The block's levels from `src` as q[j][n] (int8, k = j), two rows a step: `step(v,
  // rows)` gets rows 2v and 2v + 1 (64 bytes) for v = 0..15, in order. Output row pair v
  // takes low nibbles from row pair v % 8 (its high nibbles where v >= 8) and top bits
  // from top row pair v % 4, field v / 4. `kSigned`: the levels; else level + 32 (0-63,
  // as stored: an unsigned vpdpbusd operand, int8_avx512.h).
  template <bool kSigned = true, typename Step>
  static RIDGELINE_INLINE void unpack_steps(const uint8_t* src, Step&& step) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi8(0x3F);
    const __m512i bias = _mm512_set1_epi8(32);
    __m512i top[4];
    for (int s = 0; s < 4; ++s) top[s] = _mm512_loadu_si512(src + 16 * kPanel + 64 * s);
#pragma GCC unroll 16
    for (int v = 0; v < 16; ++v) {
      const __m512i nibbles = _mm512_loadu_si512(src + 64 * (v % 8));
      const __m512i low = v < 8 ? nibbles : _mm512_srli_epi16(nibbles, 4);
      const __m512i t = top[v % 4];
      // Field v / 4 to bits 4-5 (16-bit shifts: what crosses a byte is masked away).
      const __m512i high = v < 4    ? _mm512_slli_epi16(t, 4)
                           : v < 8  ? _mm512_slli_epi16(t, 2)
                           : v < 12 ? t
                                    : _mm512_srli_epi16(t, 2);
      // Bits 0-3 from low, 4-7 from high (0xCA: low4 ? low : high), then 6 bits kept.
      const __m512i u = _mm512_and_si512(_mm512_ternarylogic_epi32(low4, low, high, 0xCA), low6);
      step(v, kSigned ? _mm512_sub_epi8(u, bias) : u);
    }
  }
  // The block's levels into q[j][n] in memory (1 KB).
  static RIDGELINE_INLINE void unpack(const uint8_t* src, int8_t* q) {
    unpack_steps(src, [q](int v, __m512i rows) { _mm512_store_si512(q + 64 * v, rows); });
  }
  static inline __m512 scales16(const int8_t* c, const float* s) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_loadu_ps(s));
  }
  RIDGELINE_INLINE Block block(int64_t p, int64_t b) const {
    const int64_t g = global(p, b);
    Block bl;
    bl.codes = codes + 2 * g * kPanel;
    bl.supers = supers + (g / 8) * kPanel;
    bl.d0 = scales16(bl.codes, bl.supers);
    bl.d1 = scales16(bl.codes + 16, bl.supers + 16);
    bl.e0 = scales16(bl.codes + 32, bl.supers);
    bl.e1 = scales16(bl.codes + 48, bl.supers + 16);
    bl.packed = qs + g * kPackedBytes;
    unpack(bl.packed, bl.q);
    return bl;
  }
  // Read ahead as Q8_0 does (the LM head of a Q4_K_M file is Q6_K): the levels, codes and
  // supers kReadAhead blocks on, one line per j.
  static constexpr bool kReadsAhead = true;
  static constexpr int64_t kReadAhead = Q8_0::kReadAhead;
  static inline void read_ahead(const Block& bl, int j) {
    if (j < kPackedBytes / 64)
      prefetch::t1(bl.packed, kReadAhead * kPackedBytes + 64 * j);
    else if (j == kPackedBytes / 64)
      prefetch::t1(bl.codes, kReadAhead * 2 * kPanel);
    else if (j == kPackedBytes / 64 + 1)
      prefetch::t1(bl.supers, kReadAhead / 8 * kPanel * 4);
    else if (j == kPackedBytes / 64 + 2)
      prefetch::t1(bl.supers, kReadAhead / 8 * kPanel * 4 + 64);
  }
  static inline void levels(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                            __m512& hi1) {
    lo0 = Q8_0::level(bl.q + j * kPanel);
    lo1 = Q8_0::level(bl.q + j * kPanel + 16);
    hi0 = Q8_0::level(bl.q + (j + 16) * kPanel);
    hi1 = Q8_0::level(bl.q + (j + 16) * kPanel + 16);
  }
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    levels(bl, j, lo0, lo1, hi0, hi1);
    lo0 = _mm512_mul_ps(lo0, bl.d0);
    lo1 = _mm512_mul_ps(lo1, bl.d1);
    hi0 = _mm512_mul_ps(hi0, bl.e0);
    hi1 = _mm512_mul_ps(hi1, bl.e1);
  }
  // acc += d * (the sum of q * x over k = j) + e * (the sum over k = j + 16).
  static inline void add_halves(const Block& bl, __m512 lo0, __m512 lo1, __m512 hi0,
                                __m512 hi1, __m512& acc0, __m512& acc1) {
    acc0 = _mm512_fmadd_ps(bl.e0, hi0, _mm512_fmadd_ps(bl.d0, lo0, acc0));
    acc1 = _mm512_fmadd_ps(bl.e1, hi1, _mm512_fmadd_ps(bl.d1, lo1, acc1));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // `at` is the block's index g (its codes and supers follow from it).
  inline int64_t at(int64_t p, int64_t b) const { return global(p, b); }
  inline const uint8_t* levels_at(int64_t p, int64_t b) const {
    return qs + global(p, b) * kPackedBytes;
  }
  static constexpr int64_t kLevelBytes = kPackedBytes;
  // The levels of k = j (lo) and k = j + 16 (hi) of outputs 8g .. 8g+7: their u's top
  // bits sit at 2f and 2f + 4 (f = j / 8) of one byte.
  static inline void levels8(const uint8_t* q, int j, int g, __m256& lo, __m256& hi) {
    const auto load8 = [&](int row) {
      return _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + row * kPanel + 8 * g)));
    };
    const __m256i nibbles = load8(j), top = load8(16 + j % 8);
    const __m256i bits45 = _mm256_set1_epi32(0x30), bias = _mm256_set1_epi32(32);
    const __m128i up = _mm_cvtsi32_si128(4 - 2 * (j / 8)), down = _mm_cvtsi32_si128(2 * (j / 8));
    const __m256i u_lo = _mm256_or_si256(_mm256_and_si256(nibbles, _mm256_set1_epi32(0x0F)),
                                         _mm256_and_si256(_mm256_sll_epi32(top, up), bits45));
    const __m256i u_hi = _mm256_or_si256(_mm256_srli_epi32(nibbles, 4),
                                         _mm256_and_si256(_mm256_srl_epi32(top, down), bits45));
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(u_lo, bias));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(u_hi, bias));
  }
  // The scales of half h of block `at`, outputs 8g .. 8g+7.
  inline __m256 scale8(int64_t at, int h, int g) const {
    const __m128i raw =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (2 * at + h) * kPanel + 8 * g));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)),
                         _mm256_loadu_ps(supers + (at / 8) * kPanel + 8 * g));
  }
  inline void widen8(const uint8_t* q, int64_t at, int j, int g, __m256& lo, __m256& hi) const {
    levels8(q, j, g, lo, hi);
    lo = _mm256_mul_ps(lo, scale8(at, 0, g));
    hi = _mm256_mul_ps(hi, scale8(at, 1, g));
  }
  inline __m256 add_block8(int64_t at, int g, __m256 lo, __m256 hi, float /*x_sum*/,
                           __m256 acc) const {
    acc = _mm256_fmadd_ps(scale8(at, 0, g), lo, acc);
    return _mm256_fmadd_ps(scale8(at, 1, g), hi, acc);
  }
#endif
};

}  // namespace quant
