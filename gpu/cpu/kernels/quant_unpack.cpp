// A run of panels' weights widened into a k-major matrix, for one large matmul.
//
// Why: a GGUF's layers hold nothing but their blocks (gpu/cpu/linear.py: the file is
// the weights), so a call of many rows (a prefill chunk, a large decode batch) needs the
// weights in a form a matmul library multiplies at its peak. Widening a slice of panels
// into a scratch buffer and handing it to oneDNN costs one pass over the slice's weights
// per call, against a matmul that reads it once per 16-64 rows of x: at hundreds of rows
// the pass is a few percent of the call.
//
// out [K, width] (row stride `ld`, float32 or bfloat16) gets W.T for panels [p0, p1):
// out[k][32 (p - p0) + n] = weight k of output 32p + n, as the exact kernels widen it
// (quant_blocks.h: d * q + m, or q * d), rounded to bf16 to nearest even where out is
// bf16 (the value a bf16 checkpoint of the same weights holds). Rows of the last panel
// past N are its zero padding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "q8_16_blocks.h"

namespace {

using namespace quant;

// 32 widened weights (one k, a panel's outputs) stored as float32 or bf16; bf16 rounded
// to nearest even as c10::BFloat16(float) rounds (NaN as 0x7FC0), 16 lanes at a time
// with AVX-512: a scalar conversion per weight was most of a call's time.
inline void store32(const float* w, float* out) { std::memcpy(out, w, 32 * sizeof(float)); }
inline void store32(const float* w, c10::BFloat16* out) {
#ifdef __AVX512F__
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i nan = _mm512_set1_epi32(0x7FC0);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_load_ps(w + 16 * h);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), _mm512_cvtepi32_epi16(r));
  }
#else
  for (int n = 0; n < 32; ++n) out[n] = c10::BFloat16(w[n]);
#endif
}

template <typename W, typename T>
void unpack(const W& w, int64_t p0, int64_t p1, T* out, int64_t ld) {
  const int64_t blocks = w.K / kBlock;
  at::parallel_for(p0, p1, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float k_lo[kPanel], k_hi[kPanel];
    for (int64_t p = begin; p < end; ++p) {
      T* col = out + (p - p0) * kPanel;
      for (int64_t b = 0; b < blocks; ++b) {
#ifdef __AVX512F__
        const auto bl = w.block(p, b);
#elif defined(__AVX2__) && defined(__FMA__)
        const auto* q = w.levels_at(p, b);
        const int64_t at = w.at(p, b);
#endif
        for (int j = 0; j < 16; ++j) {
#ifdef __AVX512F__
          __m512 lo0, lo1, hi0, hi1;
          W::widen(bl, j, lo0, lo1, hi0, hi1);
          _mm512_store_ps(k_lo, lo0);
          _mm512_store_ps(k_lo + 16, lo1);
          _mm512_store_ps(k_hi, hi0);
          _mm512_store_ps(k_hi + 16, hi1);
#elif defined(__AVX2__) && defined(__FMA__)
          for (int g = 0; g < 4; ++g) {
            __m256 lo, hi;
            w.widen8(q, at, j, g, lo, hi);
            _mm256_store_ps(k_lo + 8 * g, lo);
            _mm256_store_ps(k_hi + 8 * g, hi);
          }
#else
          for (int64_t n = 0; n < kPanel; ++n) {
            k_lo[n] = w.weight(p, b * kBlock + j, n);
            k_hi[n] = w.weight(p, b * kBlock + j + 16, n);
          }
#endif
          store32(k_lo, col + (b * kBlock + j) * ld);
          store32(k_hi, col + (b * kBlock + j + 16) * ld);
        }
      }
    }
  });
}

int64_t check(const at::Tensor& qweight, at::ScalarType qtype, int64_t per_block,
              const at::Tensor& out, int64_t p0, int64_t p1, const char* op) {
  TORCH_CHECK(qweight.scalar_type() == qtype && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == per_block && qweight.size(3) == kPanel,
              op, ": qweight must be contiguous ", qtype, " [panels, K/32, ", per_block,
              ", 32], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t K = qweight.size(1) * kBlock;
  TORCH_CHECK(0 <= p0 && p0 < p1 && p1 <= qweight.size(0), op, ": panels [", p0, ", ", p1,
              ") outside [0, ", qweight.size(0), ")");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                  out.dim() == 2 && out.size(0) == K && out.size(1) == (p1 - p0) * kPanel &&
                  out.stride(1) == 1,
              op, ": out must be float32 or bfloat16 [K, 32 * panels] = [", K, ", ",
              (p1 - p0) * kPanel, "] with contiguous rows, got ", out.scalar_type(), " ",
              out.sizes());
  return K;
}

template <typename W>
void unpack_into(const W& w, int64_t p0, int64_t p1, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat)
    unpack(w, p0, p1, out.mutable_data_ptr<float>(), out.stride(0));
  else
    unpack(w, p0, p1, out.mutable_data_ptr<c10::BFloat16>(), out.stride(0));
}

void q4_1_unpack(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t p0, int64_t p1, at::Tensor& out) {
  const int64_t K = check(qweight, at::kByte, 16, out, p0, p1, "q4_1_unpack");
  unpack_into(Q4_1{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                   mins.const_data_ptr<float>(), K}, p0, p1, out);
}

void q8_0_unpack(const at::Tensor& qweight, const at::Tensor& scales, int64_t p0, int64_t p1,
                 at::Tensor& out) {
  const int64_t K = check(qweight, at::kChar, kBlock, out, p0, p1, "q8_0_unpack");
  unpack_into(Q8_0{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), K}, p0,
              p1, out);
}

void q8_16_unpack(const at::Tensor& levels, const at::Tensor& codes, const at::Tensor& supers,
                  int64_t p0, int64_t p1, at::Tensor& out) {
  const Q8_16 w = Q8_16::of(levels, codes, supers, "q8_16_unpack");
  check(levels, at::kByte, 24, out, p0, p1, "q8_16_unpack");
  unpack_into(w, p0, p1, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_unpack(Tensor qweight, Tensor scales, Tensor mins, int p0, int p1, "
        "Tensor(a!) out) -> ()");
  m.def("q8_0_unpack(Tensor qweight, Tensor scales, int p0, int p1, Tensor(a!) out) -> ()");
  m.def("q8_16_unpack(Tensor levels, Tensor codes, Tensor supers, int p0, int p1, "
        "Tensor(a!) out) -> ()");
  m.impl("q4_1_unpack", c10::DispatchKey::CPU, TORCH_FN(q4_1_unpack));
  m.impl("q8_0_unpack", c10::DispatchKey::CPU, TORCH_FN(q8_0_unpack));
  m.impl("q8_16_unpack", c10::DispatchKey::CPU, TORCH_FN(q8_16_unpack));
}
