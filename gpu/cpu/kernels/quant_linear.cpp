// x @ W.T on CPU straight from GGUF-quantized weights (Q4_1, Q8_0, Q8_16), fp32 or bf16
// activations.
//
// Why: at decode (a few rows of x) a linear layer is memory-bound on its weight. The
// embedded SmolLM2 ships Q4_1 linears and a Q8_0 LM head; dequantized to fp32 at load
// they stream 4 bytes per weight every step. Read as quantized blocks they stream
// 0.75 (Q4_1: 16 nibble bytes + fp32 d and m per 32) or 1.125 (Q8_0) bytes per weight
// and are widened in registers.
//
// Formats, layout and exactness: quant_blocks.h (a Q4_1 layer's levels held as the bf16
// dot kernel's pairs instead: q4_1_pairs.h).
//
// Algorithm, parallel over panels; x's rows are split into tiles of equal size, at most
// kTile (12), each read in place (row stride xs):
//   - up to kPerBlockMaxRows (4) x rows: the levels q (not yet scaled) are multiplied
//     into the rows, and the scales are applied once per block. At so few rows the
//     kernel is bound by the instructions that widen the weights, not by memory (a
//     row reads slower than a plain sum would); this drops the per-weight scaling, 4
//     of 12 such instructions per 64 weights for Q4_1. Past 4 rows the block sums take
//     more registers than the saved instructions are worth. Q8_0 (the LM head, one
//     row at a bf16 decode step) reads its blocks ahead into L2 (Q8_0::read_ahead): a
//     step's other weights have pushed the head's out of cache by the time it runs, and
//     with the hardware's prefetchers alone the widening waits on memory, well below
//     the speed of a plain read of the same bytes;
//   - up to kDirectMaxRows (24) x rows: per tile, each block is widened in registers and
//     multiplied into the tile's rows (x[m][k] broadcast), never stored. A panel's
//     weights (12-30 KB) stay in L1/L2 for its second tile;
//   - more rows: per chunk of kChunk k the panel's weights are widened once into an L1
//     buffer ([kChunk][32] floats, 16 KB) and every tile runs over it with 2 x kTile
//     accumulators, carried across chunks in the output. Blocking k that way keeps the
//     buffer in L1 and x's rows in L2.
// Why the switch sits at 24 rows: widening a block again for each tile costs fewer
// cycles than storing it to the buffer and loading it back, until the tiles' FMAs are
// most of the work; the two paths cross near 24-32 rows for SmolLM2's shapes
// (benchmarks/cpu_quant_linear_ab.py). Rows are split into tiles of equal size (9 + 9
// for 18 rows, not 12 + 6), which keeps every tile's FMA chains equally long.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "entry_points.h"
#include "q4_1_pairs.h"
#include "round_bf16.h"
#include "q8_16_blocks.h"

#ifdef __AVX512F__
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include "quant_linear_avx2.h"
#endif

namespace {

using namespace quant;

constexpr int64_t kDirectMaxRows = 24;  // widen in registers, once per tile, up to here
// The loops over a block's 16 k pairs are unrolled (`#pragma GCC unroll 16`), so that j
// is a constant in each copy: the pairs' widening (q4_1_pairs.h) shifts by immediates,
// not by a count in a register (two micro-ops on Intel), and every format's widening
// folds its offsets (benchmarks/cpu_quant_linear_ab.py times the paths).

#ifdef __AVX512F__
// T rows of a panel's 32 outputs (row stride os), the lanes past `cols` left alone.
template <int T>
inline void store_rows(const __m512 (&acc)[T][2], float* out, int64_t os, __mmask16 m0,
                       __mmask16 m1) {
  for (int t = 0; t < T; ++t) {
    _mm512_mask_storeu_ps(out + t * os, m0, acc[t][0]);
    _mm512_mask_storeu_ps(out + t * os + 16, m1, acc[t][1]);
  }
}

// T x rows (row stride xs) against panel p, widened block by block in registers.
template <int T, typename W>
inline void tile_direct(const W& w, int64_t p, const float* x, int64_t xs, float* out,
                        int64_t os, int64_t cols) {
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    const auto bl = w.block(p, b);
    #pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      __m512 lo0, lo1, hi0, hi1;
      W::widen(bl, j, lo0, lo1, hi0, hi1);
      for (int t = 0; t < T; ++t) {
        const __m512 xa = _mm512_set1_ps(x[t * xs + b * kBlock + j]);
        const __m512 xb = _mm512_set1_ps(x[t * xs + b * kBlock + j + 16]);
        acc[t][0] = _mm512_fmadd_ps(lo0, xa, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(lo1, xa, acc[t][1]);
        acc[t][0] = _mm512_fmadd_ps(hi0, xb, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(hi1, xb, acc[t][1]);
      }
    }
  }
  __mmask16 m0, m1;
  column_masks(cols, m0, m1);
  store_rows<T>(acc, out, os, m0, m1);
}

// T x rows against panel p with the scales applied once per block: the levels q are
// multiplied into the x rows (no per-weight scaling), and each block adds d * sum(q x)
// + m * sum(x) (x_sums: [T][K/32], row stride ks).
template <int T, typename W>
inline void tile_per_block(const W& w, int64_t p, const float* x, int64_t xs,
                           const float* x_sums, int64_t ks, float* out, int64_t os,
                           int64_t cols) {
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    const auto bl = w.block(p, b);
    // qx: sum(q x) over the block; where it has a scale per half (kHalfScales), over
    // k = j only, and hx over k = j + 16, so that each half is scaled once.
    __m512 qx[T][2], hx[T][2];
    for (int t = 0; t < T; ++t) qx[t][0] = qx[t][1] = hx[t][0] = hx[t][1] = _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      if constexpr (W::kReadsAhead) W::read_ahead(bl, j);
      __m512 lo0, lo1, hi0, hi1;
      W::levels(bl, j, lo0, lo1, hi0, hi1);
      for (int t = 0; t < T; ++t) {
        const __m512 xa = _mm512_set1_ps(x[t * xs + b * kBlock + j]);
        const __m512 xb = _mm512_set1_ps(x[t * xs + b * kBlock + j + 16]);
        if constexpr (W::kHalfScales) {
          qx[t][0] = _mm512_fmadd_ps(lo0, xa, qx[t][0]);
          qx[t][1] = _mm512_fmadd_ps(lo1, xa, qx[t][1]);
          hx[t][0] = _mm512_fmadd_ps(hi0, xb, hx[t][0]);
          hx[t][1] = _mm512_fmadd_ps(hi1, xb, hx[t][1]);
        } else {
          qx[t][0] = _mm512_fmadd_ps(hi0, xb, _mm512_fmadd_ps(lo0, xa, qx[t][0]));
          qx[t][1] = _mm512_fmadd_ps(hi1, xb, _mm512_fmadd_ps(lo1, xa, qx[t][1]));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      if constexpr (W::kHalfScales)
        W::add_halves(bl, qx[t][0], qx[t][1], hx[t][0], hx[t][1], acc[t][0], acc[t][1]);
      else
        W::add_block(bl, qx[t][0], qx[t][1], x_sums[t * ks + b], acc[t][0], acc[t][1]);
    }
  }
  __mmask16 m0, m1;
  column_masks(cols, m0, m1);
  store_rows<T>(acc, out, os, m0, m1);
}

// R x rows (row stride xs, from the chunk's first k) against kc widened k of a panel
// (wbuf: [kc][32]), added to what `out` holds unless this is the first chunk.
template <int R>
inline void tile_buffered(const float* wbuf, int64_t kc, const float* x, int64_t xs, float* out,
                          int64_t os, int64_t cols, bool first) {
  __mmask16 m0, m1;
  column_masks(cols, m0, m1);
  __m512 acc[R][2];
  for (int t = 0; t < R; ++t) {
    acc[t][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, out + t * os);
    acc[t][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, out + t * os + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wbuf + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(wbuf + k * kPanel + 16);
    for (int t = 0; t < R; ++t) {
      const __m512 xv = _mm512_set1_ps(x[t * xs + k]);
      acc[t][0] = _mm512_fmadd_ps(w0, xv, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, xv, acc[t][1]);
    }
  }
  store_rows<R>(acc, out, os, m0, m1);
}

#endif

template <typename W>
void quant_linear(const W& w, const float* x_ptr, int64_t M, int64_t xs, int64_t N,
                  float* out_ptr) {
  // The AVX2 path (quant_linear_avx2.h) takes its own from w and N.
  [[maybe_unused]] const int64_t K = w.K, panels = (N + kPanel - 1) / kPanel;
#ifdef __AVX512F__
  // ~64k weights per task at least: below that a thread's start costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  // Tiles of equal size (18 rows: 9 + 9, not 12 + 6).
  const int64_t tiles = (M + kTile - 1) / kTile, tile = (M + tiles - 1) / tiles;
  if (M <= kPerBlockMaxRows) {
    const int64_t blocks = K / kBlock;
    const std::vector<float> x_sums = block_sums(x_ptr, M, xs, blocks);
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        with_rows<kPerBlockMaxRows>(M, [&](auto T) {
          tile_per_block<decltype(T)::value>(w, p, x_ptr, xs, x_sums.data(), blocks,
                                             out_ptr + p * kPanel, N, cols);
        });
      }
    });
    return;
  }
  if (M <= kDirectMaxRows) {
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        for (int64_t r0 = 0; r0 < M; r0 += tile) {
          with_rows(std::min(tile, M - r0), [&](auto T) {
            tile_direct<decltype(T)::value>(w, p, x_ptr + r0 * xs, xs,
                                            out_ptr + r0 * N + p * kPanel, N, cols);
          });
        }
      }
    });
    return;
  }
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> wbuf(kChunk * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t b = k0 / kBlock; b < (k0 + kc) / kBlock; ++b) {
          const auto bl = w.block(p, b);
          #pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            __m512 lo0, lo1, hi0, hi1;
            W::widen(bl, j, lo0, lo1, hi0, hi1);
            float* row = wbuf.data() + (b * kBlock - k0 + j) * kPanel;
            _mm512_storeu_ps(row, lo0);
            _mm512_storeu_ps(row + 16, lo1);
            _mm512_storeu_ps(row + 16 * kPanel, hi0);
            _mm512_storeu_ps(row + 16 * kPanel + 16, hi1);
          }
        }
        for (int64_t r0 = 0; r0 < M; r0 += tile) {
          with_rows(std::min(tile, M - r0), [&](auto R) {
            tile_buffered<decltype(R)::value>(wbuf.data(), kc, x_ptr + r0 * xs + k0, xs,
                                              out_ptr + r0 * N + p * kPanel, N, cols,
                                              k0 == 0);
          });
        }
      }
    }
  });
#elif defined(__AVX2__) && defined(__FMA__)
  avx2::quant_linear(w, x_ptr, M, xs, N, out_ptr);
#else
  // Portable: widen a panel into [K][32] floats, then plain loops.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(K * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < kPanel; ++n) wbuf[k * kPanel + n] = w.weight(p, k, n);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t n = 0; n < cols; ++n) {
          float s = 0.f;
          for (int64_t k = 0; k < K; ++k) s += x_ptr[i * xs + k] * wbuf[k * kPanel + n];
          out_ptr[i * N + p * kPanel + n] = s;
        }
    }
  });
#endif
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), op,
              ": x must be 2-D [M, K] with contiguous rows (any row stride), got sizes ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
}

// qweight [P, K/32, rows_per_block, 32] of `dtype`; returns K. Checks N fits the panels.
int64_t check_panels(const at::Tensor& qweight, at::ScalarType dtype, int64_t rows_per_block,
                     int64_t N, const char* op) {
  TORCH_CHECK(qweight.scalar_type() == dtype && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == rows_per_block && qweight.size(3) == kPanel,
              op, ": qweight must be contiguous ", dtype, " [panels, K/32, ", rows_per_block,
              ", 32], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t panels = qweight.size(0), K = qweight.size(1) * kBlock;
  TORCH_CHECK(K > 0 && N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs (K = ", K, ")");
  return K;
}

void check_per_block(const at::Tensor& s, const at::Tensor& qweight, const char* name,
                     const char* op) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                  s.size(0) == qweight.size(0) && s.size(1) == qweight.size(1) &&
                  s.size(2) == kPanel,
              op, ": ", name, " must be contiguous float32 [panels, K/32, 32], got ",
              s.scalar_type(), " ", s.sizes());
}

// x @ W.T in float32, for x of either dtype. bf16 x (a bf16 layer's calls of few rows:
// gpu/cpu/linear.py) is widened on the way in, exactly, and the float32 sums are rounded
// to bf16 once on the way out (nearest even, as torch's `.to(torch.bfloat16)`): the same
// values as `op(x.float()).to(torch.bfloat16)`, without the two Python-dispatched
// conversions per call (~240 a one-row decode step of SmolLM2). The float32 copies live
// in per-thread buffers, not tensors: a one-row call is short enough that allocating
// them shows.
template <typename W>
at::Tensor in_float32(const W& w, const at::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    quant_linear(w, x.const_data_ptr<float>(), M, x.stride(0), N, out.mutable_data_ptr<float>());
    return out;
  }
  // Kept per thread up to 4 MB each (a few-row call's), allocated per call above.
  constexpr int64_t kKept = 1 << 20;
  static thread_local std::vector<float> kept_x, kept_out;
  std::vector<float> once_x, once_out;
  std::vector<float>& xv = M * K <= kKept ? kept_x : once_x;
  std::vector<float>& ov = M * N <= kKept ? kept_out : once_out;
  xv.resize(M * K);
  ov.resize(M * N);
  const c10::BFloat16* xb = x.const_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) xv[i * K + k] = static_cast<float>(xb[i * x.stride(0) + k]);
  quant_linear(w, xv.data(), M, K, N, ov.data());
  round_to_bf16(ov.data(), out.mutable_data_ptr<c10::BFloat16>(), M * N);
  return out;
}

}  // namespace

namespace kernels {

// A Q4_1 layer held as the dot kernel's pairs (q4_1_pairs.h): the same values.
static at::Tensor q4_1_pairs_linear(const at::Tensor& x, const at::Tensor& qpairs,
                             const at::Tensor& scales, const at::Tensor& mins, int64_t N) {
  const char* op = "q4_1_linear";
  const int64_t K = check_panels(qpairs, at::kInt, 4, N, op);
  check_x(x, K, op);
  const Q4_1Scales sc = Q4_1Scales::of(scales, mins, qpairs.size(0), K, op);
#ifdef __AVX512F__
  const auto* qp = reinterpret_cast<const uint32_t*>(qpairs.const_data_ptr<int32_t>());
  if (sc.d != nullptr) return in_float32(Q4_1Pairs<false>{qp, sc, K}, x, N);
  return in_float32(Q4_1Pairs<true>{qp, sc, K}, x, N);
#else
  TORCH_CHECK(false, op, ": levels as dot pairs are read on AVX-512 only");
#endif
}

// qweight: the panels' levels (uint8 [P, K/32, 16, 32]), or the dot kernel's pairs
// (int32 [P, K/32, 4, 32], `PanelBlocks.dot_pairs`) with float32 scales or a Q4_K's codes.
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N) {
  if (qweight.scalar_type() == at::kInt) return q4_1_pairs_linear(x, qweight, scales, mins, N);
  const int64_t K = check_panels(qweight, at::kByte, 16, N, "q4_1_linear");
  check_x(x, K, "q4_1_linear");
  check_per_block(scales, qweight, "scales", "q4_1_linear");
  check_per_block(mins, qweight, "mins", "q4_1_linear");
  const Q4_1 w{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
               mins.const_data_ptr<float>(), K};
  return in_float32(w, x, N);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t N) {
  const int64_t K = check_panels(qweight, at::kChar, kBlock, N, "q8_0_linear");
  check_x(x, K, "q8_0_linear");
  check_per_block(scales, qweight, "scales", "q8_0_linear");
  const Q8_0 w{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), K};
  return in_float32(w, x, N);
}

// Q8_16's levels, codes and supers as q8_16_blocks.h lays them out.
at::Tensor q8_16_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& codes,
                        const at::Tensor& supers, int64_t N) {
  const Q8_16 w = Q8_16::of(levels, codes, supers, "q8_16_linear");
  const int64_t panels = levels.size(0);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "q8_16_linear: N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
  check_x(x, w.K, "q8_16_linear");
  return in_float32(w, x, N);
}

}  // namespace kernels

// A fragment: paged_decode.cpp owns the library's one TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int N) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor qweight, Tensor scales, int N) -> Tensor");
  m.def("q8_16_linear(Tensor x, Tensor levels, Tensor codes, Tensor supers, int N) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, TORCH_FN(kernels::q4_1_linear));
  m.impl("q8_0_linear", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_0_linear));
  m.impl("q8_16_linear", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_16_linear));
}
