// x @ W.T on CPU straight from GGUF-quantized weights (Q4_1, Q8_0), fp32 activations.
//
// Why: at decode (a few rows of x) a linear layer is memory-bound on its weight. The
// embedded SmolLM2 ships Q4_1 linears and a Q8_0 LM head; dequantized to fp32 at load
// they stream 4 bytes per weight every step. Read as quantized blocks they stream
// 0.75 (Q4_1: 16 nibble bytes + fp32 d and m per 32) or 1.125 (Q8_0) bytes per weight
// and are widened in registers.
//
// Exactness: every weight is dequantized exactly as gguf-py's numpy dequantizer does
// it in float32 — Q4_1 `(d * q) + m` (two roundings: a multiply, then an add), Q8_0
// `q * d` — so the served fp32 weights and these agree bit for bit, and the results
// differ from an fp32 matmul only by summation order. The multiply and add must stay
// separate instructions: build.py passes -ffp-contract=off, since GCC would otherwise
// fuse _mm512_mul_ps + _mm512_add_ps into one FMA (one rounding). The dot products use
// explicit _mm512_fmadd_ps, which that flag leaves alone.
//
// Algorithm: parallel over groups of kRows output rows (weight rows). Per group:
//   - few x rows (<= kFusedMaxRows): per tile of up to kTile x rows, each weight block
//     is dequantized into registers and multiplied into all the tile's rows, never
//     stored (Q4_1 through a 16-entry table per block: see Q4_1::block);
//   - more x rows: the group's rows are dequantized once into a per-thread fp32 buffer
//     (kRows * K floats, L1-sized for K <= 1536) and every tile of x runs over it, so
//     the dequantization is paid once per weight per call whatever the batch.
// The micro-kernel keeps kRows x tile accumulators (16 zmm) over K and reduces them
// with the shared-shuffle `reduce4`. A short last group reuses its last row (a dummy
// row whose results are dropped) rather than branching in the loop.
//
// Layout: x [M, K] fp32, any row stride, contiguous K. Q4_1: qweight uint8 [N, K/2],
// per row the blocks' 16 qs bytes in order, weight j = qs[j] & 15, j + 16 = qs[j] >> 4
// (GGML order); scales, mins fp32 [N, K/32]. Q8_0: qweight int8 [N, K]; scales fp32
// [N, K/32]. Returns [M, N] fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "reduce.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per GGML block (Q4_1 and Q8_0 alike)
constexpr int64_t kRows = 4;    // weight rows per group: one reduce4 per x row
constexpr int64_t kTile = 4;    // x rows per micro-kernel call: 4 x 4 accumulators
// Up to this many x rows, each tile dequantizes the blocks again in registers; above
// it, the buffer's one dequantization wins (measured: 8 beats 4 and 16 on this host).
constexpr int64_t kFusedMaxRows = 8;

// One Q4_1 weight matrix: `dequant_row` (portable) or `block` (AVX-512) widens it.
struct Q4_1 {
  const uint8_t* qs;
  const float* d;
  const float* m;
  int64_t K;

  void dequant_row(int64_t n, float* out) const {
    const int64_t nb = K / kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = qs + n * (K / 2) + b * 16;
      const float scale = d[n * nb + b], min = m[n * nb + b];
      for (int j = 0; j < 16; ++j) {
        const float lo = scale * static_cast<float>(q[j] & 0x0F);
        const float hi = scale * static_cast<float>(q[j] >> 4);
        out[b * kBlock + j] = lo + min;
        out[b * kBlock + j + 16] = hi + min;
      }
    }
  }

#ifdef __AVX512F__
  // Block b of row n: weights 0..15 in lo, 16..31 in hi. A block has only 16 distinct
  // values, so they are computed once into a 16-float table (d * q, then + m, in the
  // same two roundings) and each weight is a table lookup: one permute per 16 weights
  // where converting and scaling each would take three. The permute reads the low 4
  // bits of each lane, so the low nibbles need no mask.
  inline void block(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const int64_t nb = K / kBlock;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d[n * nb + b]), iota),
                                       _mm512_set1_ps(m[n * nb + b]));
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + n * (K / 2) + b * 16)));
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
#endif
};

// One Q8_0 weight matrix.
struct Q8_0 {
  const int8_t* qs;
  const float* d;
  int64_t K;

  void dequant_row(int64_t n, float* out) const {
    const int64_t nb = K / kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      const float scale = d[n * nb + b];
      for (int j = 0; j < kBlock; ++j)
        out[b * kBlock + j] = static_cast<float>(qs[n * K + b * kBlock + j]) * scale;
    }
  }

#ifdef __AVX512F__
  inline void block(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const __m256i q =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + n * K + b * kBlock));
    const __m512 scale = _mm512_set1_ps(d[n * (K / kBlock) + b]);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                       scale);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                       scale);
  }
#endif
};

#ifdef __AVX512F__
// Writes one x row's kRows sums: columns [0, cols) of them.
inline void store_sums(__m128 sums, float* out, int64_t cols) {
  if (cols == kRows)
    _mm_storeu_ps(out, sums);
  else
    _mm_mask_storeu_ps(out, static_cast<__mmask8>((1u << cols) - 1), sums);
}

// T x rows against weight rows rows[0..kRows), dequantized block by block in registers.
template <int T, typename W>
inline void tile_from_blocks(const W& w, const int64_t (&rows)[kRows],
                             const float* const* x, float* const* out, int64_t cols) {
  __m512 acc[kRows][T];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t nb = w.K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 xlo[T], xhi[T];
    for (int t = 0; t < T; ++t) {
      xlo[t] = _mm512_loadu_ps(x[t] + b * kBlock);
      xhi[t] = _mm512_loadu_ps(x[t] + b * kBlock + 16);
    }
    for (int r = 0; r < kRows; ++r) {
      __m512 lo, hi;
      w.block(rows[r], b, lo, hi);
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm512_fmadd_ps(lo, xlo[t], acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(hi, xhi[t], acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    store_sums(reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]), out[t], cols);
}

// T x rows against kRows dequantized weight rows in `wbuf` (row r at r * K).
template <int T>
inline void tile_from_buffer(const float* wbuf, int64_t K, const float* const* x,
                             float* const* out, int64_t cols) {
  __m512 acc[kRows][T];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x[t] + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512 wv = _mm512_loadu_ps(wbuf + r * K + k);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t)
    store_sums(reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]), out[t], cols);
}

// Dispatch on the tile's row count so each micro-kernel's loops have constant bounds
// (fully unrolled, accumulators in registers).
template <typename Fn>
inline void with_tile_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}
#endif

template <typename W>
void quant_linear(const W& w, const at::Tensor& x, int64_t N, at::Tensor& out) {
  const int64_t M = x.size(0), K = w.K, x_row = x.stride(0);
  const float* x_ptr = x.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  const int64_t groups = (N + kRows - 1) / kRows;
  // ~64k weights per task at least: below that a thread's start costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kRows * K));

  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(kRows * K);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows, cols = std::min(kRows, N - n0);
      int64_t rows[kRows];
      for (int64_t r = 0; r < kRows; ++r) rows[r] = n0 + std::min(r, cols - 1);
#ifdef __AVX512F__
      const bool from_blocks = M <= kFusedMaxRows;
      if (!from_blocks)
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t b = 0; b < K / kBlock; ++b) {
            __m512 lo, hi;
            w.block(rows[r], b, lo, hi);
            _mm512_storeu_ps(wbuf.data() + r * K + b * kBlock, lo);
            _mm512_storeu_ps(wbuf.data() + r * K + b * kBlock + 16, hi);
          }
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t tile = std::min(kTile, M - m0);
        const float* xs[kTile];
        float* outs[kTile];
        for (int64_t t = 0; t < tile; ++t) {
          xs[t] = x_ptr + (m0 + t) * x_row;
          outs[t] = out_ptr + (m0 + t) * N + n0;
        }
        with_tile_rows(tile, [&](auto T) {
          if (from_blocks)
            tile_from_blocks<decltype(T)::value>(w, rows, xs, outs, cols);
          else
            tile_from_buffer<decltype(T)::value>(wbuf.data(), K, xs, outs, cols);
        });
      }
#else
      for (int64_t r = 0; r < cols; ++r) w.dequant_row(rows[r], wbuf.data() + r * K);
      for (int64_t i = 0; i < M; ++i) {
        const float* xi = x_ptr + i * x_row;
        for (int64_t r = 0; r < cols; ++r) {
          const float* wr = wbuf.data() + r * K;
          float s = 0.f;
          for (int64_t k = 0; k < K; ++k) s += xi[k] * wr[k];
          out_ptr[i * N + n0 + r] = s;
        }
      }
#endif
    }
  });
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), op,
              ": x must be 2-D [M, K] with contiguous rows (any row stride), got sizes ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
}

void check_scales(const at::Tensor& s, int64_t N, int64_t K, const char* name, const char* op) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == N && s.size(1) == K / kBlock,
              op, ": ", name, " must be contiguous float32 [N, K/32] = [", N, ", ", K / kBlock,
              "], got ", s.scalar_type(), " ", s.sizes());
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 &&
                  qweight.is_contiguous(),
              "q4_1_linear: qweight must be contiguous uint8 [N, K/2], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(K % kBlock == 0 && K > 0, "q4_1_linear: K = ", K, " must be a positive multiple of 32");
  check_x(x, K, "q4_1_linear");
  check_scales(scales, N, K, "scales", "q4_1_linear");
  check_scales(mins, N, K, "mins", "q4_1_linear");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  const Q4_1 w{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
               mins.const_data_ptr<float>(), K};
  quant_linear(w, x, N, out);
  return out;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.is_contiguous(),
              "q8_0_linear: qweight must be contiguous int8 [N, K], got ", qweight.scalar_type(),
              " ", qweight.sizes());
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K % kBlock == 0 && K > 0, "q8_0_linear: K = ", K, " must be a positive multiple of 32");
  check_x(x, K, "q8_0_linear");
  check_scales(scales, N, K, "scales", "q8_0_linear");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  const Q8_0 w{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), K};
  quant_linear(w, x, N, out);
  return out;
}

}  // namespace

// A fragment: paged_decode.cpp owns the library's one TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, TORCH_FN(q4_1_linear));
  m.impl("q8_0_linear", c10::DispatchKey::CPU, TORCH_FN(q8_0_linear));
}
