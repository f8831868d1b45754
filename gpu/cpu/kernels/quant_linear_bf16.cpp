// x @ W.T for a bf16 model's calls of few rows, straight from a GGUF's Q4_1 blocks, with
// the AVX512-BF16 dot product: bf16 x in, bf16 out.
//
// Why: at one or two rows the exact float32 kernel (quant_linear.cpp) is bound by the
// instructions that widen the weights, not by memory: per 128 weights four
// zero-extensions, four shifts, eight table lookups and eight FMAs. vdpbf16ps
// multiplies pairs of bf16 values into float32 lanes, two weights per lane, so each
// level needs only to become a bf16 in the right half of a lane: per 128 weights three
// shifts, four word table lookups and four dot products. The levels 0..15 are exact in
// bf16, and so is x of a bf16 model.
//
// Layout (`PanelBlocks.dot_pairs`, repacked at load from the panels of quant_blocks.h):
// per panel, block and chunk c < 4, one dword per output n, its low word holding the
// levels of k = 4c + i + 16 and its high word those of k = 4c + i in nibble i (i < 4).
// A 64-byte load is 16 outputs' dwords; shifted right by 4s per word, each word has
// nibble s in its bits 0-3, and a word table lookup (vpermw reads bits 0-4 of each word;
// the table repeats bf16(0..15) twice, so bit 4 is don't-care) makes lane n the pair
// (bf16 q of k = j + 16, bf16 q of k = j), j = 4c + s. x is packed once per call in the
// same pairs, so the dot product adds both products into output n's float32 lane: lanes
// stay outputs, nothing to un-permute at the store.
//
// Exactness: bit for bit quant_linear.cpp's few-row path (x widened to float32, sums
// rounded to bf16). vdpbf16ps adds a lane's high product to the accumulator, then its
// low one, each rounded once (Intel's definition), and a product of two bf16 values is
// exact in float32: so each instruction is the float32 kernel's two FMAs, k = j then
// k = j + 16, and the kernel keeps that kernel's order of k per block and its
// d * sum(q x) + m * sum(x) per block. Differences only where vdpbf16ps treats bf16
// denormal inputs as zero and flushes denormal results (below 1.2e-38), and for NaN
// payloads; the float32 sums are rounded to bf16 to nearest even (vcvtneps2bf16).
// The row counts this path takes: gpu/cpu/routing.py (`BF16_DOT_MAX_ROWS`).
//
// Read-ahead: at one row a block's loads wait on memory unless asked for early, so the
// loop asks L2 (not L1: that leaves the L1 fill buffers to the loads themselves) for the
// levels, scales and mins kPrefetchBlocks blocks ahead, across panels (each stream is
// contiguous over a call's panels), and past the last one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "entry_points.h"
#include "q4_1_scales.h"
#include "quant_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

using namespace quant;

constexpr int kMaxRows = 4;  // rows of x per call this kernel takes
constexpr int kPairedBlocks = 2;  // blocks whose dot-product chains run side by side
constexpr int64_t kPrefetchBlocks = 4;  // blocks read ahead (`benchmarks/cpu_quant_bf16_ab.py`)

// bf16(i & 15) for i < 32: the word table vpermw indexes with bits 0-4.
alignas(64) constexpr uint16_t kLevels[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Each row's sum of q x over NB consecutive blocks (q: the first block's dwords, xr: its
// x pairs, row stride xs), qx[nb][t][half]. One chain per block, row and output half,
// k in quant_linear.cpp's order (j, j + 16 for j = 0..15): vdpbf16ps adds its lane's
// high product, then its low one, each rounded once, as the float32 kernel's two FMAs
// do, so the sums are its bit for bit. NB blocks' chains run side by side: the dot
// product's latency is several times its issue interval.
template <int T, int NB>
inline void block_products(const uint32_t* q, const uint32_t* xr, int64_t xs, __m512i table,
                           __m512 (&qx)[NB][T][2]) {
  for (int nb = 0; nb < NB; ++nb)
    for (int t = 0; t < T; ++t) qx[nb][t][0] = qx[nb][t][1] = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    __m512i raw[NB][2];
    for (int nb = 0; nb < NB; ++nb) {
      raw[nb][0] = _mm512_loadu_si512(q + (nb * 4 + c) * kPanel);
      raw[nb][1] = _mm512_loadu_si512(q + (nb * 4 + c) * kPanel + 16);
    }
    for (int s = 0; s < 4; ++s)
      for (int nb = 0; nb < NB; ++nb) {
        // Nibble s of each word in its bits 0-3 (bit 4 is don't-care: the table repeats).
        const __m512bh lv0 =
            as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(raw[nb][0], 4 * s), table));
        const __m512bh lv1 =
            as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(raw[nb][1], 4 * s), table));
        for (int t = 0; t < T; ++t) {
          const __m512bh xv =
              as_bh(_mm512_set1_epi32(static_cast<int>(xr[t * xs + nb * 16 + 4 * c + s])));
          qx[nb][t][0] = _mm512_dpbf16_ps(qx[nb][t][0], lv0, xv);
          qx[nb][t][1] = _mm512_dpbf16_ps(qx[nb][t][1], lv1, xv);
        }
      }
  }
}

// T rows of x against panel p: qp the dot pairs, sc the scales and mins, xp [T][K/2]
// packed x pairs, x_sums [T][K/32]; out: T rows of the panel's outputs (row stride os),
// `cols` of them real. acc += d * sum(q x) + m * sum(x), block by block in order.
template <int T, bool kCoded>
inline void panel(const uint32_t* qp, const Q4_1Scales sc, int64_t K, int64_t p,
                  const uint32_t* xp, const float* x_sums, c10::BFloat16* out, int64_t os,
                  int64_t cols) {
  const int64_t blocks = K / kBlock;
  const __m512i table = _mm512_load_si512(kLevels);
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  auto add = [&](int64_t b, const __m512 (&qx)[T][2]) {
    __m512 d0, d1, m0, m1;
    sc.load<kCoded>(p, b, 0, d0, m0);
    sc.load<kCoded>(p, b, 1, d1, m1);
    for (int t = 0; t < T; ++t) {
      const __m512 xs = _mm512_set1_ps(x_sums[t * blocks + b]);
      acc[t][0] = _mm512_fmadd_ps(m0, xs, _mm512_fmadd_ps(d0, qx[t][0], acc[t][0]));
      acc[t][1] = _mm512_fmadd_ps(m1, xs, _mm512_fmadd_ps(d1, qx[t][1], acc[t][1]));
    }
  };
  const uint32_t* q = qp + p * blocks * kPanel * 4;  // [blocks][4 chunks][32 outputs]
  const int64_t ahead = p * blocks + kPrefetchBlocks;
  int64_t b = 0;
  for (; b + kPairedBlocks <= blocks; b += kPairedBlocks) {
    for (int nb = 0; nb < kPairedBlocks; ++nb) sc.read_ahead<kCoded>(qp, ahead + b + nb);
    __m512 qx[kPairedBlocks][T][2];
    block_products<T, kPairedBlocks>(q + b * kPanel * 4, xp + b * 16, K / 2, table, qx);
    for (int nb = 0; nb < kPairedBlocks; ++nb) add(b + nb, qx[nb]);
  }
  for (; b < blocks; ++b) {
    sc.read_ahead<kCoded>(qp, ahead + b);
    __m512 qx[1][T][2];
    block_products<T, 1>(q + b * kPanel * 4, xp + b * 16, K / 2, table, qx);
    add(b, qx[0]);
  }
  store_bf16_panel<T>(acc, out, os, cols);
}

// x's rows as the kernel reads them: pairs of bf16 bits, x[32b + j + 16] in the low
// half and x[32b + j] in the high one (as the levels),
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
        xp[t * K / 2 + b * 16 + j] = bits[at + j + 16] | static_cast<uint32_t>(bits[at + j]) << 16;
    }
}

}  // namespace

namespace kernels {

// x [M <= 4, K] bf16 @ W.T for the Q4_1 weight given by `PanelBlocks.dot_pairs` (qpairs)
// and the panels' scales and mins (float32, or a Q4_K's codes and supers: q4_1_scales.h),
// N real outputs: bf16 [M, N] (entry_points.h: the fused decode call runs it without the
// dispatcher).
at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& qpairs,
                            const at::Tensor& scales, const at::Tensor& mins, int64_t N) {
  const char* op = "q4_1_linear_bf16";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              op, ": x must be bfloat16 [M, K] with contiguous rows, got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(0) <= kMaxRows, op, ": x has ", x.size(0), " rows, at most ", kMaxRows);
  TORCH_CHECK(qpairs.scalar_type() == at::kInt && qpairs.dim() == 4 && qpairs.is_contiguous() &&
                  qpairs.size(2) == 4 && qpairs.size(3) == kPanel,
              op, ": qpairs must be contiguous int32 [panels, K/32, 4, 32] (PanelBlocks.dot_pairs), got ",
              qpairs.scalar_type(), " ", qpairs.sizes());
  const int64_t panels = qpairs.size(0), K = qpairs.size(1) * kBlock, M = x.size(0);
  const Q4_1Scales sc = Q4_1Scales::of(scales, mins, panels, K, op);
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  static thread_local std::vector<uint32_t> xp;
  static thread_local std::vector<float> sums;
  pack_x(x, xp, sums);
  const auto* qp = reinterpret_cast<const uint32_t*>(qpairs.const_data_ptr<int32_t>());
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  // ~64k weights per task at least, as quant_linear.cpp.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  const uint32_t* xp_ptr = xp.data();
  const float* sums_ptr = sums.data();
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      with_rows<kMaxRows>(M, [&](auto T) {
        if (sc.d != nullptr)
          panel<decltype(T)::value, false>(qp, sc, K, p, xp_ptr, sums_ptr, out_ptr + p * kPanel,
                                           N, cols);
        else
          panel<decltype(T)::value, true>(qp, sc, K, p, xp_ptr, sums_ptr, out_ptr + p * kPanel,
                                          N, cols);
      });
    }
  });
  return out;
}

// The layout above from the panels' levels (qweight [P, K/32, 16, 32] uint8): done at
// load, once per weight, in one parallel pass over the bytes (in int64 tensor
// arithmetic it was most of a large model's load).
at::Tensor q4_1_dot_pairs(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 4 &&
                  qweight.is_contiguous() && qweight.size(2) == 16 && qweight.size(3) == kPanel,
              "q4_1_dot_pairs: qweight must be contiguous uint8 [panels, K/32, 16, 32], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t blocks = qweight.size(0) * qweight.size(1);
  at::Tensor out = at::empty({qweight.size(0), qweight.size(1), 4, kPanel},
                             qweight.options().dtype(at::kInt));
  const uint8_t* q = qweight.const_data_ptr<uint8_t>();
  uint32_t* o = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<int32_t>());
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int c = 0; c < 4; ++c)
        for (int n = 0; n < kPanel; ++n) {
          uint32_t low = 0, high = 0;  // k = 4c + i + 16 (high nibbles), k = 4c + i
          for (int i = 0; i < 4; ++i) {
            const uint32_t v = q[(b * 16 + 4 * c + i) * kPanel + n];
            low |= (v >> 4) << (4 * i);
            high |= (v & 0x0F) << (4 * i);
          }
          o[(b * 4 + c) * kPanel + n] = low | (high << 16);
        }
  });
  return out;
}

}  // namespace kernels

// Registered only where AVX512-BF16 and VBMI were compiled in: callers look them up by name.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear_bf16(Tensor x, Tensor qpairs, Tensor scales, Tensor mins, int N) -> Tensor");
  m.def("q4_1_dot_pairs(Tensor qweight) -> Tensor");
  m.impl("q4_1_linear_bf16", c10::DispatchKey::CPU, TORCH_FN(kernels::q4_1_linear_bf16));
  m.impl("q4_1_dot_pairs", c10::DispatchKey::CPU, TORCH_FN(kernels::q4_1_dot_pairs));
}
#endif
