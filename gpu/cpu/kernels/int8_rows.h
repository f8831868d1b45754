// x's rows quantized to int8 for the int8 kernels (quant_linear_int8.cpp): the rows'
// levels, scales and exact sums, and the span of them an AVX-512 tile reads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_pairs.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define RIDGELINE_INT8_ROWS_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include "int8_avx2.h"
#endif

#if defined(RIDGELINE_INT8_ROWS_AVX512) || (defined(__AVX2__) && defined(__FMA__))
namespace quant {

// x's rows quantized per block of 32, block-major so that a tile's rows sit at fixed
// offsets from one pointer: levels [K/32][M][32], scales and exact sums [K/32][M]
// (quantized per super-block, `quantize_rows<8>`: each sum over its super-block's scale,
// 0 where that is 0, which the tile multiplies back with its partial sum); for a Q8_16
// tile (`q8_16_bias`), -32 times each 16 levels' sum [K/16][M], what its weights stored as
// level + 32 add to the integer sums (int8_avx512.h `tile_q8_16`).
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> bias16;
  int64_t M = 0, blocks = 0;
};

#ifdef RIDGELINE_INT8_ROWS_AVX512
// What an AVX-512 tile reads of the rows: blocks [b0, b1) of them, and whether those
// start the sums (`first`: else the tile adds to what `out` holds, the sums of the
// blocks before, in the same order as one pass would).
struct Int8Span {
  const int8_t* q;
  const float *d, *sum;
  const int32_t* bias16;
  int64_t M, b0, b1;
  bool first;
  Int8Span(const Int8Rows& r, int64_t b0_, int64_t b1_)
      : q(r.q.data()), d(r.d.data()), sum(r.sum.data()), bias16(r.bias16.data()), M(r.M),
        b0(b0_), b1(b1_), first(b0_ == 0) {}
};
#endif

// Symmetric per block, as llama.cpp's Q8_0: d = max|x| / 127, q = round-to-even(x / d)
// (computed as x * (1 / d): cvtps rounds to nearest even); an all-zero block has d = 0
// and levels 0. x float32 or bf16 (widened exactly); the levels in k order, or in
// `kPairOrder` for the pairs; `q8_16_bias`: with `Int8Rows.bias16`.
// `kSuperBlocks` blocks per scale: 1, or 8 for a tile against a K-quant's
// super-blocks of 256 k (int8_pairs.h `tile_pairs_super`, int8_avx512.h `tile_q8_16`), as
// llama.cpp's Q8_K: max|x| over the 256, each block's `d` that scale; the sums stay per
// block and exact.
template <int kSuperBlocks = 1>
inline Int8Rows quantize_rows(const at::Tensor& x, bool pair_order, bool q8_16_bias = false) {
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* src = bf16 ? nullptr : x.const_data_ptr<float>();
  const c10::BFloat16* src16 = bf16 ? x.const_data_ptr<c10::BFloat16>() : nullptr;
  Int8Rows r;
  r.M = M;
  r.blocks = K / kBlock;
  r.q.resize(M * K);
  r.d.resize(M * r.blocks);
  r.sum.resize(M * r.blocks);
  if (q8_16_bias) r.bias16.resize(M * r.blocks * 2);
  constexpr int64_t G = kSuperBlocks, kValues = G * kBlock;
  // Item i: row t's group of G blocks from block b = G * (i / M).
  at::parallel_for(0, M * (r.blocks / G), 256 / G, [&](int64_t begin, int64_t end) {
    float widened[kValues];
#ifdef RIDGELINE_INT8_ROWS_AVX512
    const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kPairOrder));
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = G * (i / M), t = i % M;
      const float* v = src + t * xs + b * kBlock;
      if (bf16) {
        const c10::BFloat16* h = src16 + t * xs + b * kBlock;
#ifdef RIDGELINE_INT8_ROWS_AVX512  // a bf16's bits are a float's upper half
        for (int64_t j = 0; j < kValues; j += 16)
          _mm512_storeu_si512(widened + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + j))), 16));
#else
        for (int64_t j = 0; j < kValues; ++j) widened[j] = static_cast<float>(h[j]);
#endif
        v = widened;
      }
#ifndef RIDGELINE_INT8_ROWS_AVX512
      const float d = avx2::abs_max(v, kValues) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (b + g) * M + t;
        int8_t* q = r.q.data() + at * kBlock;
        const float sum = avx2::quantize_block(v + g * kBlock, inv, q);
        r.d[at] = d;
        r.sum[at] = G == 1 ? sum : sum * inv;
        if (q8_16_bias)
          for (int64_t h = 0; h < 2; ++h) {
            int32_t levels = 0;
            for (int64_t j = 0; j < 16; ++j) levels += q[16 * h + j];
            r.bias16[(2 * (b + g) + h) * M + t] = -32 * levels;
          }
        if (pair_order) {
          int8_t k_order[kBlock];
          std::memcpy(k_order, q, kBlock);
          for (int64_t j = 0; j < kBlock; ++j) q[j] = k_order[kPairOrder[j]];
        }
      }
#else
      __m512 amax = _mm512_setzero_ps();
      for (int64_t j = 0; j < kValues; j += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
      const float d = _mm512_reduce_max_ps(amax) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      const __m512 scale = _mm512_set1_ps(inv);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = (b + g) * M + t;
        const __m512 v0 = _mm512_loadu_ps(v + g * kBlock),
                     v1 = _mm512_loadu_ps(v + g * kBlock + 16);
        __m256i q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(
                _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)))),
            _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, scale))), 1);
        if (pair_order) q = _mm256_permutexvar_epi8(order, q);  // q[j] = k order's [order[j]]
        if (q8_16_bias) {  // each 16 levels' sum: q + 128 as bytes summed by 8, less 16 * 128
          const __m256i u = _mm256_xor_si256(q, flip);
          const __m256i by8 = _mm256_sad_epu8(u, _mm256_setzero_si256());
          const int64_t lo = _mm256_extract_epi64(by8, 0) + _mm256_extract_epi64(by8, 1),
                        hi = _mm256_extract_epi64(by8, 2) + _mm256_extract_epi64(by8, 3);
          r.bias16[2 * (b + g) * M + t] = -32 * static_cast<int32_t>(lo - 16 * 128);
          r.bias16[(2 * (b + g) + 1) * M + t] = -32 * static_cast<int32_t>(hi - 16 * 128);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + at * kBlock), q);
        r.d[at] = d;
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        r.sum[at] = G == 1 ? sum : sum * inv;
      }
#endif
    }
  });
  return r;
}

}  // namespace quant
#endif
