// Horizontal sums for the CPU kernels (paged_decode.cpp), for 16-lane (AVX-512) or 8-lane
// (AVX2) registers.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums sharing their shuffles
// (~9 instructions where four _mm512_reduce_add_ps take ~32).
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // per 128-bit lane: [a0 a1 a0 a1] and [a2 a3 a2 a3] partial sums
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // per 128-bit lane: [a0 a1 a2 a3]
  const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 half = _mm256_add_ps(
      _mm512_castps512_ps256(s),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

#ifdef __AVX2__
#include <immintrin.h>

// The same for 8-lane registers (AVX2).
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // per 128-bit lane: [a0 a1 a2 a3] partial sums
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline float reduce_add8(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline float reduce_max8(__m256 a) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
#endif
