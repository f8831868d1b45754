// x @ W.T on CPU straight from GGUF-quantized weights (Q4_1, Q8_0), fp32 activations.
//
// Why: at decode (a few rows of x) a linear layer is memory-bound on its weight. The
// embedded SmolLM2 ships Q4_1 linears and a Q8_0 LM head; dequantized to fp32 at load
// they stream 4 bytes per weight every step. Read as quantized blocks they stream
// 0.75 (Q4_1: 16 nibble bytes + fp32 d and m per 32) or 1.125 (Q8_0) bytes per weight
// and are widened in registers.
//
// Exactness: every weight is dequantized exactly as gguf-py's numpy dequantizer does
// it in float32 — Q4_1 `(d * q) + m` (a multiply, then an add), Q8_0 `q * d` — so the
// served fp32 weights and these agree bit for bit, and the results differ from an fp32
// matmul only by summation order. Q4_1 widens with one fused multiply-add all the same:
// d and m are f16 values in a GGUF (11 significant bits), so d * q (q < 16) is exact in
// fp32 and only the add rounds, in both. That holds only for f16 scales, so PanelBlocks
// refuses others (gpu/cpu_linear.py). One instruction fewer per 16 weights: 0.86x the
// time at one row with the weights in cache, 0.95x at 8.
//
// Layout: panels of kPanel = 32 output rows (gpu/cpu_linear.py repacks the GGUF's row
// order at load; N is padded to whole panels with zero blocks). Per panel p and block
// b (32 k): Q4_1 qweight[p][b][j][n] (uint8, j < 16) holds weight k = 32b + j of
// output 32p + n in its low nibble and k = 32b + j + 16 in its high one (GGML's pairing,
// transposed); Q8_0 qweight[p][b][j][n] (int8, j < 32) holds k = 32b + j. scales (and
// Q4_1's mins) [p][b][n], fp32. So one 32-byte load gives a k's weights for 32 outputs:
// the kernel is an outer product, outputs along the vector lanes, with no horizontal
// sums (the previous layout, one output's blocks in a row, needed them).
//
// Algorithm, parallel over panels; x's rows are split into tiles of equal size, at most
// kTile (12), each read in place (row stride xs):
//   - up to kDirectMaxRows (24) x rows: per tile, each block is widened in registers and
//     multiplied into the tile's rows (x[m][k] broadcast), never stored. A panel's
//     weights (12-30 KB) stay in L1/L2 for its second tile;
//   - more rows: per chunk of kChunk k the panel's weights are widened once into an L1
//     buffer ([kChunk][32] floats, 16 KB) and every tile runs over it with 2 x kTile
//     accumulators, carried across chunks in the output. Blocking k that way keeps the
//     buffer in L1 and x's rows in L2.
// Why the switch sits at 24 rows: widening a block again for each tile costs fewer
// cycles than storing it to the buffer and loading it back, until the tiles' FMAs are
// most of the work. Against the buffered path (SmolLM2's four Q4_1 layer shapes, 30
// copies each, 2 threads, paired rounds): 0.86-0.94x at 13-20 rows, 0.90-0.99x at 24,
// level at 26-32 (0.96-1.05x over four rounds), 1.05x at 40; the Q8_0 head 0.84-0.90x
// at 13-24. Equal tiles (9 + 9 for 18 rows, not 12 + 6) are 0.97-0.98x at 13-30.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;          // weights per GGML block (Q4_1 and Q8_0 alike)
constexpr int64_t kPanel = 32;          // output rows per panel: two 16-lane vectors
constexpr int64_t kTile = 12;           // x rows per micro-kernel: 24 accumulators
constexpr int64_t kChunk = 128;         // k per buffered chunk: 128 x 32 floats = 16 KB
constexpr int64_t kDirectMaxRows = 24;  // widen in registers, once per tile, up to here

// One Q4_1 weight matrix in panels. `weight` (portable) or `block`/`widen` (AVX-512).
struct Q4_1 {
  const uint8_t* qs;
  const float* d;
  const float* m;
  int64_t K;

  float weight(int64_t p, int64_t k, int64_t n) const {
    const int64_t b = k / kBlock, j = k % kBlock, at = (p * (K / kBlock) + b) * kPanel + n;
    const uint8_t q = qs[((p * (K / kBlock) + b) * 16 + j % 16) * kPanel + n];
    const float scaled = d[at] * static_cast<float>(j < 16 ? q & 0x0F : q >> 4);
    return scaled + m[at];
  }

#ifdef __AVX512F__
  struct Block {
    __m512 d0, d1, m0, m1;
    const uint8_t* q;
  };
  inline Block block(int64_t p, int64_t b) const {
    const int64_t at = (p * (K / kBlock) + b) * kPanel;
    return {_mm512_loadu_ps(d + at), _mm512_loadu_ps(d + at + 16), _mm512_loadu_ps(m + at),
            _mm512_loadu_ps(m + at + 16), qs + at * 16};
  }
  // Weights k = j (lo) and k = j + 16 (hi) of the block, outputs 0-15 (0) and 16-31 (1).
  // float(q) comes from a 16-entry table: vpermps reads only the low 4 bits of each
  // index, so the low nibble needs no mask, and the lookup replaces the int-to-float
  // convert. Two instructions fewer per 64 weights than mask-and-convert: 0.97-0.98x
  // the time at 1-12 rows from memory, 0.89-0.95x with the weights in cache, level at 18.
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* q = bl.q + j * kPanel;
    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i q1 =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    lo0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q0, values), bl.d0, bl.m0);
    lo1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q1, values), bl.d1, bl.m1);
    hi0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), values), bl.d0, bl.m0);
    hi1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), values), bl.d1, bl.m1);
  }
#endif
};

// One Q8_0 weight matrix in panels.
struct Q8_0 {
  const int8_t* qs;
  const float* d;
  int64_t K;

  float weight(int64_t p, int64_t k, int64_t n) const {
    const int64_t b = k / kBlock, j = k % kBlock;
    return static_cast<float>(qs[((p * (K / kBlock) + b) * kBlock + j) * kPanel + n]) *
           d[(p * (K / kBlock) + b) * kPanel + n];
  }

#ifdef __AVX512F__
  struct Block {
    __m512 d0, d1;
    const int8_t* q;
  };
  inline Block block(int64_t p, int64_t b) const {
    const int64_t at = (p * (K / kBlock) + b) * kPanel;
    return {_mm512_loadu_ps(d + at), _mm512_loadu_ps(d + at + 16), qs + at * kBlock};
  }
  static inline __m512 row(const int8_t* q, __m512 scale) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), scale);
  }
  static inline void widen(const Block& bl, int j, __m512& lo0, __m512& lo1, __m512& hi0,
                           __m512& hi1) {
    lo0 = row(bl.q + j * kPanel, bl.d0);
    lo1 = row(bl.q + j * kPanel + 16, bl.d1);
    hi0 = row(bl.q + (j + 16) * kPanel, bl.d0);
    hi1 = row(bl.q + (j + 16) * kPanel + 16, bl.d1);
  }
#endif
};

#ifdef __AVX512F__
// Lane masks for the panel's two vectors when only `cols` of its 32 outputs exist.
inline void column_masks(int64_t cols, __mmask16& m0, __mmask16& m1) {
  m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
}

// T x rows (row stride xs) against panel p, widened block by block in registers.
template <int T, typename W>
inline void tile_direct(const W& w, int64_t p, const float* x, int64_t xs, float* out,
                        int64_t os, int64_t cols) {
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.K / kBlock; ++b) {
    const auto bl = w.block(p, b);
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
  for (int t = 0; t < T; ++t) {
    _mm512_mask_storeu_ps(out + t * os, m0, acc[t][0]);
    _mm512_mask_storeu_ps(out + t * os + 16, m1, acc[t][1]);
  }
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
  for (int t = 0; t < R; ++t) {
    _mm512_mask_storeu_ps(out + t * os, m0, acc[t][0]);
    _mm512_mask_storeu_ps(out + t * os + 16, m1, acc[t][1]);
  }
}

// Dispatch on a row count (1..kTile) so each micro-kernel's loops have constant bounds
// (fully unrolled, accumulators in registers).
template <typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 9: fn(std::integral_constant<int, 9>{}); break;
    case 10: fn(std::integral_constant<int, 10>{}); break;
    case 11: fn(std::integral_constant<int, 11>{}); break;
    default: fn(std::integral_constant<int, 12>{}); break;
  }
}
static_assert(kTile == 12, "with_rows dispatches up to 12 rows");
#endif

template <typename W>
void quant_linear(const W& w, const at::Tensor& x, int64_t N, at::Tensor& out) {
  const int64_t M = x.size(0), K = w.K, xs = x.stride(0);
  const float* x_ptr = x.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  const int64_t panels = (N + kPanel - 1) / kPanel;
#ifdef __AVX512F__
  // ~64k weights per task at least: below that a thread's start costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  // Tiles of equal size (18 rows: 9 + 9, not 12 + 6).
  const int64_t tiles = (M + kTile - 1) / kTile, tile = (M + tiles - 1) / tiles;
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
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
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

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N) {
  const int64_t K = check_panels(qweight, at::kByte, 16, N, "q4_1_linear");
  check_x(x, K, "q4_1_linear");
  check_per_block(scales, qweight, "scales", "q4_1_linear");
  check_per_block(mins, qweight, "mins", "q4_1_linear");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  const Q4_1 w{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
               mins.const_data_ptr<float>(), K};
  quant_linear(w, x, N, out);
  return out;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t N) {
  const int64_t K = check_panels(qweight, at::kChar, kBlock, N, "q8_0_linear");
  check_x(x, K, "q8_0_linear");
  check_per_block(scales, qweight, "scales", "q8_0_linear");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  const Q8_0 w{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), K};
  quant_linear(w, x, N, out);
  return out;
}

}  // namespace

// A fragment: paged_decode.cpp owns the library's one TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int N) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor qweight, Tensor scales, int N) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, TORCH_FN(q4_1_linear));
  m.impl("q8_0_linear", c10::DispatchKey::CPU, TORCH_FN(q8_0_linear));
}
