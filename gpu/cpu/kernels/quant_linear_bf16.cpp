// x @ W.T for a bf16 model's calls of few rows, straight from a GGUF's Q4_1 blocks, with
// the AVX512-BF16 dot product: bf16 x in, bf16 out.
//
// Why: at one or two rows the exact float32 kernel (quant_linear.cpp) is bound by the
// instructions that widen the weights, not by memory: per 64 weights it spends two
// zero-extensions and four table lookups on port 5, and four FMAs. vdpbf16ps multiplies
// pairs of bf16 values into float32 lanes, two weights per lane, so each level needs
// only to become a bf16 in the right half of a lane: per 128 weights one shift, four
// byte permutes and four word table lookups, and four dot products in place of eight
// FMAs. The levels 0..15 are exact in bf16, and so is x of a bf16 model.
//
// Layout (quant_blocks.h, unchanged): byte (j, n) of a block holds k = j (low nibble)
// and k = j + 16 (high) of output n. One 64-byte load takes rows j and j + 1 (32
// outputs each); S = that load shifted right by 4 per 16-bit word has each byte's high
// nibble in its low 4 bits. A two-source byte permute puts, for each output n of a half
// panel, the byte of (j, n) in the low word of lane n and the byte of S in the high
// word; a word table lookup (vpermw reads bits 0-4 of each word: the table repeats
// bf16(0..15) twice, so bit 4 and the high byte are don't-care) turns both into
// bf16(q). Lane n then holds (q of k = j, q of k = j + 16) of output n, and x is packed
// once per call in the same pairs, (x[32b + j], x[32b + j + 16]), so the dot product
// adds q_lo x[j] + q_hi x[j + 16] into output n's float32 lane: lanes stay outputs,
// nothing to un-permute at the store.
//
// Exactness: as quant_linear.cpp's few-row path, d * sum(q x) + m * sum(x) per block;
// the products of bf16 q and bf16 x are exact in float32, the sums are float32 (only
// their order differs from a float32 matmul's). vdpbf16ps treats bf16 denormal inputs
// as zero and flushes denormal results (below 1.2e-38), as a bf16 matmul on this unit
// does. The float32 sums are rounded to bf16 to nearest even once (vcvtneps2bf16).
// The row counts this path takes: gpu/cpu/routing.py (`BF16_DOT_MAX_ROWS`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

using namespace quant;

constexpr int kMaxRows = 4;  // rows of x per call this kernel takes

// bf16(i & 15) for i < 32: the word table vpermw indexes with bits 0-4.
alignas(64) constexpr uint16_t kLevels[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// Byte-permute indices for one 64-byte load (rows j, j + 1; 32 outputs each) and its
// shifted copy (indices 64 and up): part g = 2 * (row - j) + (outputs 16-31), lane n
// gets the byte of its output in byte 0 and the shifted byte in byte 2.
struct PairIndex {
  alignas(64) uint8_t idx[4][64];
  constexpr PairIndex() : idx() {
    for (int g = 0; g < 4; ++g)
      for (int n = 0; n < 16; ++n) {
        idx[g][4 * n] = static_cast<uint8_t>(16 * g + n);
        idx[g][4 * n + 2] = static_cast<uint8_t>(64 + 16 * g + n);
      }
  }
};
constexpr PairIndex kPairIndex;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// T rows of x against panel p: xp [T][K/2] packed pairs (row stride K / 2), x_sums
// [T][K/32]; out: T rows of the panel's outputs (row stride os), `cols` of them real.
template <int T>
inline void panel(const Q4_1& w, int64_t p, const uint32_t* xp, const float* x_sums,
                  c10::BFloat16* out, int64_t os, int64_t cols) {
  const int64_t blocks = w.K / kBlock;
  const __m512i table = _mm512_load_si512(kLevels);
  __m512i idx[4];
  for (int g = 0; g < 4; ++g) idx[g] = _mm512_load_si512(kPairIndex.idx[g]);
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = (p * blocks + b) * kPanel;
    const uint8_t* q = w.qs + at * 16;
    // Four chains per row (two rows of the block x two output halves), joined at the end
    // of the block: the dot products' latency is longer than one chain's issue.
    __m512 qx[T][4];
    for (int t = 0; t < T; ++t)
      for (int g = 0; g < 4; ++g) qx[t][g] = _mm512_setzero_ps();
    for (int j = 0; j < 16; j += 2) {
      const __m512i raw = _mm512_loadu_si512(q + j * kPanel);
      const __m512i high = _mm512_srli_epi16(raw, 4);
      __m512i lv[4];
      for (int g = 0; g < 4; ++g)
        lv[g] = _mm512_permutexvar_epi16(_mm512_permutex2var_epi8(raw, idx[g], high), table);
      for (int t = 0; t < T; ++t) {
        const uint32_t* xr = xp + t * (w.K / 2) + b * 16 + j;
        const __m512bh x0 = as_bh(_mm512_set1_epi32(static_cast<int>(xr[0])));
        const __m512bh x1 = as_bh(_mm512_set1_epi32(static_cast<int>(xr[1])));
        qx[t][0] = _mm512_dpbf16_ps(qx[t][0], as_bh(lv[0]), x0);
        qx[t][1] = _mm512_dpbf16_ps(qx[t][1], as_bh(lv[1]), x0);
        qx[t][2] = _mm512_dpbf16_ps(qx[t][2], as_bh(lv[2]), x1);
        qx[t][3] = _mm512_dpbf16_ps(qx[t][3], as_bh(lv[3]), x1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(w.d + at), d1 = _mm512_loadu_ps(w.d + at + 16);
    const __m512 m0 = _mm512_loadu_ps(w.m + at), m1 = _mm512_loadu_ps(w.m + at + 16);
    for (int t = 0; t < T; ++t) {
      const __m512 xs = _mm512_set1_ps(x_sums[t * blocks + b]);
      const __m512 s0 = _mm512_add_ps(qx[t][0], qx[t][2]);
      const __m512 s1 = _mm512_add_ps(qx[t][1], qx[t][3]);
      acc[t][0] = _mm512_fmadd_ps(m0, xs, _mm512_fmadd_ps(d0, s0, acc[t][0]));
      acc[t][1] = _mm512_fmadd_ps(m1, xs, _mm512_fmadd_ps(d1, s1, acc[t][1]));
    }
  }
  __mmask16 k0, k1;
  column_masks(cols, k0, k1);
  for (int t = 0; t < T; ++t) {
    auto* o = reinterpret_cast<uint16_t*>(out + t * os);
    _mm256_mask_storeu_epi16(o, k0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[t][0])));
    _mm256_mask_storeu_epi16(o + 16, k1,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[t][1])));
  }
}

// x's rows as the kernel reads them: pairs (x[32b + j], x[32b + j + 16]) of bf16 bits,
// [M][K/2], and each block's sum of x in float32, [M][K/32].
void pack_x(const at::Tensor& x, std::vector<uint32_t>& xp, std::vector<float>& sums) {
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0), blocks = K / kBlock;
  const auto* bits = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  const auto* values = x.const_data_ptr<c10::BFloat16>();
  xp.resize(M * K / 2);
  sums.resize(M * blocks);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = t * xs + b * kBlock;
      float sum = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) sum += static_cast<float>(values[at + j]);
      sums[t * blocks + b] = sum;
      for (int64_t j = 0; j < 16; ++j)
        xp[t * K / 2 + b * 16 + j] = bits[at + j] | static_cast<uint32_t>(bits[at + j + 16]) << 16;
    }
}

at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const at::Tensor& mins, int64_t N) {
  const char* op = "q4_1_linear_bf16";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              op, ": x must be bfloat16 [M, K] with contiguous rows, got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(0) <= kMaxRows, op, ": x has ", x.size(0), " rows, at most ", kMaxRows);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 4 &&
                  qweight.is_contiguous() && qweight.size(2) == 16 && qweight.size(3) == kPanel,
              op, ": qweight must be contiguous uint8 [panels, K/32, 16, 32], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t panels = qweight.size(0), K = qweight.size(1) * kBlock, M = x.size(0);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == panels && t->size(1) == K / kBlock && t->size(2) == kPanel,
                op, ": scales and mins must be contiguous float32 [panels, K/32, 32]");
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  static thread_local std::vector<uint32_t> xp;
  static thread_local std::vector<float> sums;
  pack_x(x, xp, sums);
  const Q4_1 w{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
               mins.const_data_ptr<float>(), K};
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  // ~64k weights per task at least, as quant_linear.cpp.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  const uint32_t* xp_ptr = xp.data();
  const float* sums_ptr = sums.data();
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      with_rows<kMaxRows>(M, [&](auto T) {
        panel<decltype(T)::value>(w, p, xp_ptr, sums_ptr, out_ptr + p * kPanel, N, cols);
      });
    }
  });
  return out;
}

}  // namespace

// Registered only where AVX512-BF16 and VBMI were compiled in: callers look it up by name.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear_bf16(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int N) -> Tensor");
  m.impl("q4_1_linear_bf16", c10::DispatchKey::CPU, TORCH_FN(q4_1_linear_bf16));
}
#endif
