// A Q4_1 layer's scales and mins as the bf16 kernels that read its levels regrouped
// (quant_linear_bf16.cpp, quant_linear_amx_table.cpp) take them: float32 per block, or a
// K-quant's own codes.
//
// Why codes: float32 scales and mins are 0.25 byte a weight, a third of what a decode
// step reads of a Q4_K layer (levels 0.5). Q4_K keeps per block of 32 a 6-bit scale and
// min and per super-block of 256 an f16 d and dmin: as bytes and float32 that is 0.094
// byte a weight, and a decode step streams every weight once, so its time falls with it.
//
// Layouts (gpu/cpu/panel_blocks.py `PanelBlocks`), per panel of 32 outputs:
// - float32: scales, mins [panels][K/32][32];
// - coded (Q4_K only): codes uint8 [panels][K/32][2][32] (each block's scale, then its
//   min), supers float32 [panels][K/256][2][32] (each super-block's d, then -dmin).
// Exactness: the coded scale is d * sc and the min -dmin * mn, float32 products of an f16
// value and an integer below 64, exact, so the same values as the float32 layout holds
// (gguf_repack.cpp writes those the same way).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "force_inline.h"
#include "prefetch.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace quant {

struct Q4_1Scales {
  const float* d = nullptr;  // float32 layout (null: coded)
  const float* m = nullptr;
  const uint8_t* codes = nullptr;  // coded layout
  const float* supers = nullptr;
  int64_t blocks = 0;  // K / 32

  // `scales` and `mins` as a kernel's arguments: float32 [P, K/32, 32] each, or the
  // codes (uint8 [P, K/32, 2, 32]) and the supers (float32 [P, K/256, 2, 32]).
  static Q4_1Scales of(const at::Tensor& scales, const at::Tensor& mins, int64_t panels,
                       int64_t K, const char* op) {
    Q4_1Scales s;
    s.blocks = K / 32;
    if (scales.scalar_type() == at::kByte) {
      TORCH_CHECK(scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == panels &&
                      scales.size(1) == K / 32 && scales.size(2) == 2 && scales.size(3) == 32,
                  op, ": codes must be contiguous uint8 [panels, K/32, 2, 32], got ",
                  scales.sizes());
      TORCH_CHECK(K % 256 == 0 && mins.scalar_type() == at::kFloat && mins.is_contiguous() &&
                      mins.dim() == 4 && mins.size(0) == panels && mins.size(1) == K / 256 &&
                      mins.size(2) == 2 && mins.size(3) == 32,
                  op, ": supers must be contiguous float32 [panels, K/256, 2, 32], got ",
                  mins.scalar_type(), " ", mins.sizes());
      s.codes = scales.const_data_ptr<uint8_t>();
      s.supers = mins.const_data_ptr<float>();
      return s;
    }
    for (const at::Tensor* t : {&scales, &mins})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                      t->size(0) == panels && t->size(1) == K / 32 && t->size(2) == 32,
                  op, ": scales and mins must be contiguous float32 [panels, K/32, 32], or "
                  "a Q4_K's codes and supers");
    s.d = scales.const_data_ptr<float>();
    s.m = mins.const_data_ptr<float>();
    return s;
  }

  // Asks L2 for block `block` (panel-major over every panel) of a layer held as pairs
  // `qp` with these scales: its levels (8 lines), scales and mins (2 lines each; coded, a
  // line of codes and a quarter of its super-block's four). At one row a block's loads
  // wait on memory unless asked for early. Past the call's last block these are
  // addresses of other memory or none: a prefetch never faults (prefetch.h).
  template <bool kCoded>
  RIDGELINE_INLINE void read_ahead(const uint32_t* qp, int64_t block) const {
    for (int64_t i = 0; i < 8; ++i) prefetch::t1(qp, block * 32 * 4 * 4 + 64 * i);
    if (kCoded) {
      prefetch::t1(codes, block * 64);
      prefetch::t1(supers, block / 8 * 256 + block % 4 * 64);
      return;
    }
    for (int64_t i = 0; i < 2; ++i) {
      prefetch::t1(d, block * 32 * 4 + 64 * i);
      prefetch::t1(m, block * 32 * 4 + 64 * i);
    }
  }

#if defined(__AVX512F__)
  // Outputs 16h .. 16h + 15 of block b of panel p: their scales and mins. kCoded: which
  // layout (a compile-time choice: the kernels' loops are written once for each).
  template <bool kCoded>
  RIDGELINE_INLINE void load(int64_t p, int64_t b, int h, __m512& dv, __m512& mv) const {
    if (!kCoded) {
      const int64_t at = (p * blocks + b) * 32 + 16 * h;
      dv = _mm512_loadu_ps(d + at);
      mv = _mm512_loadu_ps(m + at);
      return;
    }
    const uint8_t* c = codes + (p * blocks + b) * 64 + 16 * h;
    const float* s = supers + (p * (blocks / 8) + b / 8) * 64 + 16 * h;
    const auto widen = [](const uint8_t* q) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    };
    dv = _mm512_mul_ps(_mm512_loadu_ps(s), widen(c));
    mv = _mm512_mul_ps(_mm512_loadu_ps(s + 32), widen(c + 32));
  }
#endif
#if defined(__AVX2__)
  // Outputs n0 .. n0 + 7 of block b of panel p, as `load` gives sixteen.
  template <bool kCoded>
  RIDGELINE_INLINE void load8(int64_t p, int64_t b, int64_t n0, __m256& dv, __m256& mv) const {
    if (!kCoded) {
      const int64_t at = (p * blocks + b) * 32 + n0;
      dv = _mm256_loadu_ps(d + at);
      mv = _mm256_loadu_ps(m + at);
      return;
    }
    const uint8_t* c = codes + (p * blocks + b) * 64 + n0;
    const float* s = supers + (p * (blocks / 8) + b / 8) * 64 + n0;
    const auto widen = [](const uint8_t* q) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    };
    dv = _mm256_mul_ps(_mm256_loadu_ps(s), widen(c));
    mv = _mm256_mul_ps(_mm256_loadu_ps(s + 32), widen(c + 32));
  }
#endif
};

}  // namespace quant
