// Float vectors loaded from, and stored to, float32 or bfloat16 memory (AVX-512: 16
// lanes, AVX2: 8), so that one vector loop serves both dtypes of a kernel.
//
// Why: a loop over c10::BFloat16 values, written plainly, stays scalar (GCC does not
// vectorise the conversions); in a bf16 model the row kernels between the matmuls
// would then run several times their float32 time.
//
// Rounding is c10's: widening is exact (the 16 bits shifted up), narrowing rounds to
// nearest even, NaN becomes 0x7FC0, exactly as `c10::BFloat16(float)` does, so a
// vector loop stores the bits its scalar tail would.
//
// Two layers: loads and stores named by width (load16 / store16, load8 / store8), which
// the attention kernels mix with their own intrinsics, and over them `Vec` with `kLanes`,
// `load`, `store`, `rounded<T>`, a little arithmetic, the horizontal sum and max, and
// lane masks (`Mask`: compare, select, zero or max under a mask, compress the chosen
// lanes to the front; `Ints`: int32 lanes for bounds and indices), the build's widest
// vector, for loops written once for both widths (defined where LANES_VECTORS is). Each
// helper is the one intrinsic (or reduce.h's sequence, or AVX2's permute table for a
// compress store) a loop written for one width would call, so such a loop computes the
// same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "reduce.h"

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LANES_VECTORS 1
#endif
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
using Vec = __m512;
template <typename T> inline Vec load(const T* p) { return load16(p); }
template <typename T> inline void store(T* p, Vec v) { store16(p, v); }
template <typename T> inline Vec rounded(Vec v) { return round16<T>(v); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec floor(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for lanes holding whole numbers n in [-126, 127]: n + 127 put in the exponent bits.
inline Vec pow2(Vec n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, once rounded
inline Vec neg(Vec a) {  // the sign flipped, zeros too (0 - a would give +0 for +0)
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), sign));
}
inline float sum_lanes(Vec v) { return _mm512_reduce_add_ps(v); }
inline float max_lanes(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// Lane masks: a bit per lane here, all-ones lanes on AVX2; the comparisons are ordered
// (false where a lane is NaN).
using Mask = __mmask16;
inline Mask less(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask at_least(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm512_mask_blend_ps(m, no, yes); }
inline Vec zero_unless(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }
// m ? max(a, b) : a, per lane.
inline Vec max_where(Mask m, Vec a, Vec b) { return _mm512_mask_max_ps(a, m, a, b); }
// kLanes int32 lanes, for per-lane bounds and token ids.
using Ints = __m512i;
inline Ints load_ints(const int32_t* p) { return _mm512_loadu_si512(p); }
inline Mask in_range(int32_t t, Ints lo, Ints hi) {  // lo <= t < hi
  const __m512i tv = _mm512_set1_epi32(t);
  return _mm512_cmpge_epi32_mask(tv, lo) & _mm512_cmplt_epi32_mask(tv, hi);
}
inline Mask greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask greater(Ints a, Ints b) { return _mm512_cmpgt_epi32_mask(a, b); }
inline Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Mask either(Mask a, Mask b) { return a | b; }
inline Mask invert(Mask m) { return static_cast<Mask>(~m); }
inline bool any(Mask m) { return m != 0; }
inline Ints splat_int(int32_t x) { return _mm512_set1_epi32(x); }
inline Ints lane_ids() {  // 0, 1, .. kLanes - 1
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints select(Mask m, Ints yes, Ints no) { return _mm512_mask_blend_epi32(m, no, yes); }
inline void store_ints(int32_t* p, Ints v) { _mm512_storeu_si512(p, v); }
// The lanes of x and of ids under m, in lane order, to the front of `to` and `to_ids`;
// returns how many. The AVX2 form stores all kLanes lanes: leave room for them.
inline int64_t compress(Mask m, Vec x, Ints ids, float* to, int32_t* to_ids) {
  _mm512_mask_compressstoreu_ps(to, m, x);
  _mm512_mask_compressstoreu_epi32(to_ids, m, ids);
  return __builtin_popcount(m);
}
inline int64_t compress(Mask m, Ints x, Ints ids, int32_t* to, int32_t* to_ids) {
  _mm512_mask_compressstoreu_epi32(to, m, x);
  _mm512_mask_compressstoreu_epi32(to_ids, m, ids);
  return __builtin_popcount(m);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
template <typename T> inline Vec load(const T* p) { return load8(p); }
template <typename T> inline void store(T* p, Vec v) { store8(p, v); }
template <typename T> inline Vec rounded(Vec v) { return round8<T>(v); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec floor(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec neg(Vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline float sum_lanes(Vec v) { return reduce_add8(v); }
inline float max_lanes(Vec v) { return reduce_max8(v); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
using Mask = __m256;
inline Mask less(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline Mask at_least(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm256_blendv_ps(no, yes, m); }
inline Vec zero_unless(Mask m, Vec v) { return _mm256_and_ps(m, v); }
inline Vec max_where(Mask m, Vec a, Vec b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }
using Ints = __m256i;
inline Ints load_ints(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline Mask in_range(int32_t t, Ints lo, Ints hi) {
  const __m256i tv = _mm256_set1_epi32(t);
  return _mm256_castsi256_ps(
      _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, tv), _mm256_cmpgt_epi32(hi, tv)));
}
inline Mask greater(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask greater(Ints a, Ints b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)); }
inline Mask is_nan(Vec a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline Mask either(Mask a, Mask b) { return _mm256_or_ps(a, b); }
inline Mask invert(Mask m) { return _mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_set1_epi32(-1))); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline Ints splat_int(int32_t x) { return _mm256_set1_epi32(x); }
inline Ints lane_ids() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline Ints add(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints select(Mask m, Ints yes, Ints no) {
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(no), _mm256_castsi256_ps(yes), m));
}
inline void store_ints(int32_t* p, Ints v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}
// AVX2 has no compress store: a table gives, per 8-bit lane mask, the chosen lanes'
// indices first, and one permute moves them to the front. All 8 lanes are stored, so
// `to` and `to_ids` must have 8 writable lanes.
struct CompressTable {
  alignas(32) int32_t lanes[256][8];
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int n = 0;
      for (int l = 0; l < 8; ++l) {
        if (mask >> l & 1) lanes[mask][n++] = l;
      }
      while (n < 8) lanes[mask][n++] = 0;
    }
  }
};
inline const CompressTable kCompress;
inline int64_t compress(Mask m, Ints x, Ints ids, int32_t* to, int32_t* to_ids) {
  const int bits = _mm256_movemask_ps(m);
  const __m256i perm =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.lanes[bits]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm256_permutevar8x32_epi32(x, perm));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to_ids),
                      _mm256_permutevar8x32_epi32(ids, perm));
  return __builtin_popcount(bits);
}
inline int64_t compress(Mask m, Vec x, Ints ids, float* to, int32_t* to_ids) {
  return compress(m, _mm256_castps_si256(x), ids, reinterpret_cast<int32_t*>(to), to_ids);
}
#endif

}  // namespace lanes
