// float32 sums rounded to bf16 by the kernels that take bf16 x and multiply in float32
// (quant_linear.cpp, quant_linear_int8.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace quant {

// float32 sums rounded to bf16 as `c10::BFloat16(float)` does, bit for bit: to nearest
// even, NaN as 0x7FC0. Vectorized: an LM head's call rounds ~50k outputs.
inline void round_to_bf16(const float* in, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i nan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(in + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) out[i] = c10::BFloat16(in[i]);
}

}  // namespace quant
