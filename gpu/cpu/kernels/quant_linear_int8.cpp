// x @ W.T on CPU from GGUF blocks (Q4_1, Q8_0, Q8_16: int8_avx512.h, int8_avx2.h) with x
// quantized to int8, for AVX512-VNNI CPUs and, through int8_avx2.h, AVX2 ones: a bf16
// model's calls of many rows on CPUs without AMX (prompts, decode steps of many users:
// `--int8-batches`, gpu/cpu/routing.py), every call with `--int8-activations`. x is
// float32 or bf16 (widened exactly; the sums then rounded to bf16 once, as the exact
// kernels do); a Q4_1 layer's levels come as panels or, where the layer holds them so, as
// the bf16 dot kernel's pairs (int8_pairs.h).
//
// Why: from ~8 rows up the exact kernels (quant_linear.cpp) are bound by their fp32
// FMAs, 16 multiply-adds an instruction. VNNI's vpdpbusd does 64 byte products an
// instruction at the same rate, so with x in int8
// the work per weight is about a quarter. llama.cpp does this for every quantized
// matmul on CPU, and vLLM's GGUF kernels on CUDA do it too (Q8_1 activations).
//
// What changes: each row of x is quantized per block of 32 k, symmetric, as llama.cpp's
// Q8_0: d = max|x| / 127, q = round(x / d) (against a Q4_K's pairs and codes on AVX-512,
// per super-block of 256 k, as llama.cpp's Q8_K: int8_pairs.h `tile_pairs_super`). A
// block then adds
//   Q4_1: d_w * d_x * sum(q_w * q_x) + m_w * sum(x)   (sum(x) exact, in fp32)
//   Q8_0: d_w * d_x * sum(q_w * q_x)
// with the integer sums exact. So the result differs from the fp32 matmul by x's
// rounding to 8 bits (each value by at most 1/254 of its block's largest), and greedy
// tokens can differ from an exact run's. benchmarks/cpu_quant_linear_ab.py times the
// kernel beside the exact one and oneDNN.
//
// How: per panel half (16 outputs, a vector of 16 int32 lanes), span of blocks and tile
// of up to kTile rows, each group of 4 k: one vpermt2b gathers the group's 4 bytes per
// output from the panel layout (quant_blocks.h: a k's 32 outputs are contiguous) into
// [output][4 k], and each row's 4 x bytes are broadcast to every lane. Q4_1's byte holds
// k and k + 16, so one gather serves two groups (low and high nibbles, both unsigned
// levels 0-15 as vpdpbusd's unsigned operand). Q8_0's levels are signed, so there x is
// made unsigned (q_x + 128) and 128 * sum(q_w), counted per block with the same
// instruction, is taken off again. Per block and row the int32 sums are converted and
// scaled once. AVX2 (no VNNI, no byte permutes across lanes) does the same in its own
// way: int8_avx2.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry_points.h"
#include "force_inline.h"
#include "int8_avx512.h"
#include "int8_pairs.h"
#include "int8_rows.h"
#include "q8_16_blocks.h"
#include "quant_blocks.h"
#include "round_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define RIDGELINE_INT8 1
#define RIDGELINE_INT8_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define RIDGELINE_INT8 1
#include "int8_avx2_q8_16.h"
#endif

namespace {

using namespace quant;

// Where a call's float32 sums go: straight into a float32 result, or, for bf16 x, per
// panel and row chunk into a thread's buffer, rounded into the bf16 result once the
// panel's spans are summed (as the exact kernels round their sums). Not an [M, N] float32
// buffer: at a prompt's rows that is tens of MB, which the allocator maps afresh at every
// call (past glibc's mmap threshold) and each of its pages faults in.
struct Sums {
  float* f32;            // the result where x is float32, else null
  c10::BFloat16* bf16;   // else this
  int64_t N;
};

#ifdef RIDGELINE_INT8
#ifdef RIDGELINE_INT8_AVX512
using namespace int8_avx512;
constexpr int kInt8Tile = static_cast<int>(kTile);

// Whether half h (outputs 16h..16h+15) of a panel with `cols` outputs holds any.
inline bool half_used(int half, int64_t cols) { return cols > 16 * half; }

// T rows of x (levels from row r0) against half `half` of Q4_1 panel p.
template <int T>
inline void tile_q4_1(const Q4_1& w, int64_t p, int half, const Int8Span& x, int64_t r0,
                      float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = half_mask(half, cols);
  const __m512i index = gather_index(half), nibble = _mm512_set1_epi8(0x0F);
  const int64_t blocks = w.K / kBlock;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = sums_so_far(x, out + t * os + 16 * half, mask);
  for (int64_t b = x.b0; b < x.b1; ++b) {
    const int64_t at = (p * blocks + b) * kPanel;
    const uint8_t* q = w.qs + at * 16;
    const int8_t* xq = x.q + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d + b * x.M + r0;
    const float* xsum = x.sum + b * x.M + r0;
    __m512i dot[T];
    for (int t = 0; t < T; ++t) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i both = gather_group(q + 4 * g * kPanel, index);
      const __m512i lo = _mm512_and_si512(both, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      for (int t = 0; t < T; ++t) {
        dot[t] = _mm512_dpbusd_epi32(dot[t], lo, broadcast4(xq + t * kBlock + 4 * g));
        dot[t] = _mm512_dpbusd_epi32(dot[t], hi, broadcast4(xq + t * kBlock + 4 * g + 16));
      }
    }
    const __m512 d = _mm512_loadu_ps(w.d + at + 16 * half);
    const __m512 m = _mm512_loadu_ps(w.m + at + 16 * half);
    for (int t = 0; t < T; ++t) {
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_set1_ps(xd[t]));
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[t]), _mm512_fmadd_ps(scaled, d, acc[t]));
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os + 16 * half, mask, acc[t]);
}

// T rows of x against half `half` of Q8_0 panel p. vpdpbusd multiplies unsigned by
// signed bytes: the signed weights take the signed side, x goes as q_x + 128.
template <int T>
inline void tile_q8_0(const Q8_0& w, int64_t p, int half, const Int8Span& x, int64_t r0,
                      float* out, int64_t os, int64_t cols) {
  const __mmask16 mask = half_mask(half, cols);
  const __m512i index = gather_index(half), flip = _mm512_set1_epi8(static_cast<char>(0x80)),
                ones = _mm512_set1_epi8(1);
  const int64_t blocks = w.K / kBlock;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = sums_so_far(x, out + t * os + 16 * half, mask);
  for (int64_t b = x.b0; b < x.b1; ++b) {
    const int64_t at = (p * blocks + b) * kPanel;
    const uint8_t* q = reinterpret_cast<const uint8_t*>(w.qs + at * kBlock);
    const int8_t* xq = x.q + (b * x.M + r0) * kBlock;  // row t at t * 32
    const float* xd = x.d + b * x.M + r0;
    __m512i dot[T], wsum = _mm512_setzero_si512();
    for (int t = 0; t < T; ++t) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i levels = gather_group(q + 4 * g * kPanel, index);
      wsum = _mm512_dpbusd_epi32(wsum, ones, levels);
      for (int t = 0; t < T; ++t) {
        const __m512i xu = _mm512_xor_si512(broadcast4(xq + t * kBlock + 4 * g), flip);
        dot[t] = _mm512_dpbusd_epi32(dot[t], xu, levels);
      }
    }
    const __m512i bias = _mm512_slli_epi32(wsum, 7);  // 128 * sum(q_w)
    const __m512 d = _mm512_loadu_ps(w.d + at + 16 * half);
    for (int t = 0; t < T; ++t) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[t], bias));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sums, _mm512_set1_ps(xd[t])), d, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * os + 16 * half, mask, acc[t]);
}
#else
using avx2::half_used;
using avx2::kInt8Tile;
using avx2::tile_q4_1;
using avx2::tile_q8_0;
#endif

// Rows in chunks of at most kRowChunk, each quantized on its own (`quantize`: x's rows ->
// Int8Rows) and multiplied in parallel over panels, the chunk's rows in tiles of equal
// size, at most kMaxRows (what the tile's registers hold). Chunking keeps the rows' levels
// (K bytes a row) in L2 while every panel reads them: unchunked, a long prefill's levels
// (megabytes in all) would come from L3 once per panel half. Quantized per chunk, a
// chunk's levels are one run of memory (block b's rows kRowChunk * 32 bytes after block
// b - 1's): quantized whole, a tile's blocks lie M * 32 bytes apart, and at some M (1280,
// 1664: a step that prefills a dozen 128-token prompts) the calls ran markedly slower per
// row than at 256 (`benchmarks/cpu_int8_rows_ab.py --rows 256,1664`, capped to AVX-512).
constexpr int64_t kRowChunk = 256;
#ifdef RIDGELINE_INT8_AVX512
// And per panel, its blocks in spans of kSpanBlocks (int8_avx512.h).
#endif

// Called at each span of a panel's blocks, [b0, b1), before its tiles (Q8_16 unpacks the
// span there); by default nothing.
struct NoPanel {
  void operator()(int64_t, int64_t, int64_t) const {}
};

// `kApart`: tiles of fewer rows than the most (a decode step's, a chunk's last) each a
// function of its own (`call_apart`): inlined beside every other row count's copy, GCC
// spilled a Q8_16 8-row tile's sums (a step of 16 users) to the stack. Other kernels' tiles
// ran slower so, and stay inlined (`benchmarks/cpu_int8_rows_ab.py`).
template <int kMaxRows = kInt8Tile, bool kApart = false, typename W, typename Quantize,
          typename Tile, typename Panel = NoPanel>
void int8_linear(const W& w, const at::Tensor& x_rows, Quantize&& quantize, const Sums& out,
                 Tile&& tile, Panel&& panel = {}) {
  const int64_t N = out.N;
  const int64_t M = x_rows.size(0), panels = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * w.K));
  for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - c0),
                  tiles = (rows + kMaxRows - 1) / kMaxRows,
                  tile_rows = (rows + tiles - 1) / tiles;
    const Int8Rows x = quantize(x_rows.narrow(0, c0, rows));  // the chunk's rows, from 0
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      static thread_local std::vector<float> buffer;  // a panel's sums for bf16 x
      if (out.f32 == nullptr) buffer.resize(kRowChunk * kPanel);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        // The chunk's row r's sums at sums + r * os.
        float* sums = out.f32 != nullptr ? out.f32 + c0 * N + p * kPanel : buffer.data();
        const int64_t os = out.f32 != nullptr ? N : kPanel;
#ifdef RIDGELINE_INT8_AVX512
        for (int64_t b0 = 0; b0 < x.blocks; b0 += kSpanBlocks) {
          const Int8Span span(x, b0, std::min(x.blocks, b0 + kSpanBlocks));
          panel(p, span.b0, span.b1);
#else
        {
          const Int8Rows& span = x;
          panel(p, 0, x.blocks);
#endif
          for (int half = 0; half < 2 && half_used(half, cols); ++half)
            for (int64_t r0 = 0; r0 < rows; r0 += tile_rows)
              with_rows<kMaxRows>(std::min(tile_rows, rows - r0), [&](auto T) {
                if constexpr (!kApart || decltype(T)::value == kMaxRows)
                  tile(T, w, p, half, span, r0, sums + r0 * os, os, cols);
                else
                  call_apart(tile, T, w, p, half, span, r0, sums + r0 * os, os, cols);
              });
        }
        if (out.f32 == nullptr)
          for (int64_t r = 0; r < rows; ++r)
            round_to_bf16(sums + r * os, out.bf16 + (c0 + r) * N + p * kPanel, cols);
      }
    });
  }
}
#endif

void check_int8(const at::Tensor& x, const at::Tensor& qweight, int64_t per_block,
                const char* op) {
#ifndef RIDGELINE_INT8
  TORCH_CHECK(false, op, ": needs a CPU with AVX512-VNNI and AVX512-VBMI, or AVX2 (this build "
              "has neither)");
#endif
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              op, ": x must be float32 or bfloat16 [M, K] with contiguous rows, got ",
              x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(qweight.dim() == 4 && qweight.is_contiguous() && qweight.size(2) == per_block &&
                  qweight.size(3) == kPanel && x.size(1) == qweight.size(1) * kBlock,
              op, ": qweight must be contiguous [panels, K/32, ", per_block,
              ", 32] with K = x's, got ", qweight.sizes(), " for x ", x.sizes());
}

// An [M, N] result of x's dtype, `linear` writing its float32 sums into it (`Sums`).
template <typename Fn>
at::Tensor result(const at::Tensor& x, int64_t N, Fn&& linear) {
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  const bool f32 = x.scalar_type() == at::kFloat;
  linear(Sums{f32 ? out.mutable_data_ptr<float>() : nullptr,
              f32 ? nullptr : out.mutable_data_ptr<c10::BFloat16>(), N});
  return out;
}

}  // namespace

// The entry points (entry_points.h: decode_layers.cpp calls them directly too).
namespace kernels {

// qweight: the panels' levels (uint8 [P, K/32, 16, 32]) with float32 scales and mins, or
// the dot kernel's pairs (int32 [P, K/32, 4, 32]) with float32 scales and
// mins or a Q4_K's codes and supers.
at::Tensor q4_1_linear_int8(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const at::Tensor& mins, int64_t N) {
  const char* op = "q4_1_linear_int8";
  const bool pairs = qweight.scalar_type() == at::kInt;
  check_int8(x, qweight, pairs ? 4 : 16, op);
  TORCH_CHECK((pairs || qweight.scalar_type() == at::kByte) &&
                  N > (qweight.size(0) - 1) * kPanel && N <= qweight.size(0) * kPanel,
              op, ": uint8 panels or int32 pairs, N within them");
  if (pairs) {
    const Q4_1Scales sc = Q4_1Scales::of(scales, mins, qweight.size(0), x.size(1), op);
#ifdef RIDGELINE_INT8
    const Pairs w{reinterpret_cast<const uint32_t*>(qweight.const_data_ptr<int32_t>()), sc,
                  x.size(1)};
    return result(x, N, [&](const Sums& out) {
      using int8_pairs::tile_pairs;
      if (sc.d != nullptr) {
        int8_linear(w, x, [](const at::Tensor& c) { return quantize_rows(c, true); }, out,
                    [](auto T, auto&&... a) { tile_pairs<decltype(T)::value>(a...); });
        return;
      }
      // A Q4_K's codes: x scaled per super-block.
      using int8_pairs::kSuperTile, int8_pairs::tile_pairs_super;
      int8_linear<kSuperTile>(
          w, x, [](const at::Tensor& c) { return quantize_rows<kSuperBlocks>(c, true); }, out,
          [](auto T, auto&&... a) { tile_pairs_super<decltype(T)::value>(a...); });
    });
#else
    TORCH_CHECK(false, op, ": this build has no int8 kernels");
#endif
  }
  TORCH_CHECK(scales.sizes() == mins.sizes() && scales.is_contiguous() && mins.is_contiguous(),
              op, ": scales and mins alike");
  return result(x, N, [&](const Sums& out) {
#ifdef RIDGELINE_INT8
    const Q4_1 w{qweight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                 mins.const_data_ptr<float>(), x.size(1)};
    int8_linear(w, x, [](const at::Tensor& c) { return quantize_rows(c, false); }, out,
                [](auto T, auto&&... args) { tile_q4_1<decltype(T)::value>(args...); });
#endif
  });
}

at::Tensor q8_0_linear_int8(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, int64_t N) {
  check_int8(x, qweight, kBlock, "q8_0_linear_int8");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && N > (qweight.size(0) - 1) * kPanel &&
                  N <= qweight.size(0) * kPanel && scales.is_contiguous(),
              "q8_0_linear_int8: int8 panels, N within them, contiguous scales");
  return result(x, N, [&](const Sums& out) {
#ifdef RIDGELINE_INT8
    const Q8_0 w{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), x.size(1)};
    int8_linear(w, x, [](const at::Tensor& c) { return quantize_rows(c, false); }, out,
                [](auto T, auto&&... args) { tile_q8_0<decltype(T)::value>(args...); });
#endif
  });
}

// Q8_16's levels, codes and supers as q8_16_blocks.h lays them out. AVX-512: each thread
// unpacks a panel's span of blocks once (before its first tile) into a buffer of its own,
// in vpdpbusd's order with its scales (int8_avx512.h `unpack_q8_16_panel`); AVX2 likewise
// a whole panel, in vpmaddubsw's order (int8_avx2.h), or for one or two rows none: they
// read the packed blocks straight.
at::Tensor q8_16_linear_int8(const at::Tensor& x, const at::Tensor& levels,
                             const at::Tensor& codes, const at::Tensor& supers, int64_t N) {
  const char* op = "q8_16_linear_int8";
  const Q8_16 w = Q8_16::of(levels, codes, supers, op);
  check_int8(x, levels, 24, op);
  TORCH_CHECK(N > (levels.size(0) - 1) * kPanel && N <= levels.size(0) * kPanel, op,
              ": N within the panels");
  return result(x, N, [&](const Sums& out) {
#ifdef RIDGELINE_INT8_AVX512
    // Each thread's panel, unpacked (64-byte aligned: the tile loads it so).
    static thread_local std::vector<__m512i> panel;
    int8_linear<kQ8_16Tile, true>(
        w, x, [](const at::Tensor& c) { return quantize_rows<kSuperBlocks>(c, false, true); },
        out,
        [](auto T, const Q8_16&, int64_t, auto&&... a) {
          tile_q8_16<decltype(T)::value>(reinterpret_cast<const int8_t*>(panel.data()), a...);
        },
        [&](int64_t p, int64_t b0, int64_t b1) {
          panel.resize(kSpanBlocks * Q8_16Panel::kBytes / 64);
          unpack_q8_16_panel(w, p, b0, b1, reinterpret_cast<int8_t*>(panel.data()));
        });
#elif defined(RIDGELINE_INT8)
    if (x.size(0) > 2) {  // each thread's panel, unpacked once for every row tile
      static thread_local std::vector<uint8_t> panel;
      int8_linear<avx2::kQ8_16Tile>(
          w, x, [](const at::Tensor& c) { return quantize_rows<kSuperBlocks>(c, false, true); },
          out,
          [](auto T, const Q8_16& w, int64_t p, auto&&... a) {
            avx2::tile_q8_16<decltype(T)::value>(w, p, panel.data(), a...);
          },
          [&](int64_t p, int64_t, int64_t) {
            panel.resize(w.K / kBlock * avx2::kQ8_16Unpacked);
            avx2::unpack_q8_16_panel(w, p, panel.data());
          });
      return;
    }
    const Int8Rows rows = quantize_rows<kSuperBlocks>(x, false);  // one or two rows
    std::vector<float> buffer(out.f32 != nullptr ? 0 : rows.M * N);  // a small float32 one
    float* sums = out.f32 != nullptr ? out.f32 : buffer.data();
    at::parallel_for(0, (N + kPanel - 1) / kPanel, std::max<int64_t>(1, 65536 / (kPanel * w.K)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t p = begin; p < end; ++p)
                         with_rows<2>(rows.M, [&](auto T) {
                           avx2::tile_q8_16_rows<decltype(T)::value>(
                               w, p, rows, 0, sums + p * kPanel, N,
                               std::min(kPanel, N - p * kPanel));
                         });
                     });
    if (out.f32 == nullptr) round_to_bf16(sums, out.bf16, rows.M * N);
#endif
  });
}

}  // namespace kernels

namespace {

bool int8_linear_supported() {
#ifdef RIDGELINE_INT8
  return true;
#else
  return false;
#endif
}

// The blocks of 32 k that share one scale of x in a K-quant layer's int8 calls (a Q4_K's
// pairs with codes, Q8_16): a super-block's 8.
int64_t int8_k_quant_x_blocks() { return kSuperBlocks; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("int8_linear_supported() -> bool");
  m.impl("int8_linear_supported", c10::DispatchKey::CatchAll, TORCH_FN(int8_linear_supported));
  m.def("int8_k_quant_x_blocks() -> int");
  m.impl("int8_k_quant_x_blocks", c10::DispatchKey::CatchAll, TORCH_FN(int8_k_quant_x_blocks));
  m.def("q4_1_linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int N) -> Tensor");
  m.def("q8_0_linear_int8(Tensor x, Tensor qweight, Tensor scales, int N) -> Tensor");
  m.impl("q4_1_linear_int8", c10::DispatchKey::CPU, TORCH_FN(kernels::q4_1_linear_int8));
  m.impl("q8_0_linear_int8", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_0_linear_int8));
#ifdef RIDGELINE_INT8  // callers look it up by name
  m.def("q8_16_linear_int8(Tensor x, Tensor levels, Tensor codes, Tensor supers, int N) -> Tensor");
  m.impl("q8_16_linear_int8", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_16_linear_int8));
#endif
}
