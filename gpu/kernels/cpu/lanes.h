// Float vectors loaded from, and stored to, float32 or bfloat16 memory (AVX-512: 16
// lanes, AVX2: 8), so that one vector loop serves both dtypes of a kernel.
//
// Why: a loop over c10::BFloat16 values, written plainly, stays scalar (GCC does not
// vectorise the conversions); in a bf16 model the row kernels between the matmuls
// then ran 5-13x their float32 time (SiLU-and-mul at 64 rows: 926 us a call against
// ~70 us, a quarter of the decode step).
//
// Rounding is c10's: widening is exact (the 16 bits shifted up), narrowing rounds to
// nearest even, NaN becomes 0x7FC0, exactly as `c10::BFloat16(float)` does, so a
// vector loop stores the bits its scalar tail would.
#pragma once

#include <c10/util/BFloat16.h>

#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace lanes {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Each lane's bfloat16 bits, in the low half of its 32.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
// v rounded as T(v) rounds it, still in float lanes: `T(a * b)` in a vector loop.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits8(v);
  // Eight 32-bit lanes (each < 2^16) to eight 16-bit ones: pack within each half, then
  // bring the halves' low quarters together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
#endif

}  // namespace lanes
