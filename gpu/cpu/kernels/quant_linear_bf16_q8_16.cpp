// x @ W.T for a bf16 model's calls of few rows from Q8_16 blocks (a Q6_K's or Q3_K's
// levels and scales, q8_16_blocks.h) with the AVX512-BF16 dot product: bf16 x in, bf16
// out. quant_linear_bf16.cpp does the same for Q4_1.
//
// Why: at one row the exact float32 kernel (quant_linear.cpp) is bound by the
// instructions that widen the levels, not by memory: per 64 weights it unpacks the 6-bit
// levels (five instructions), then sign-extends and converts each 16 of them to float32
// (eight) before four FMAs, so a Q4_K_M's Q6_K layers and LM head, a quarter of its
// weights, stream from memory slower than its Q4_K ones (`benchmarks/cpu_int8_rows_ab.py`
// times both kernels per row count). vdpbf16ps multiplies pairs of bf16 values into
// float32 lanes, so each level needs only to become a bf16 in the right half of a lane:
// per 64 weights the same unpacking, one byte permute that pairs consecutive k, two
// zero-extensions to words and two word table lookups (the level's 6 bits index
// bf16(level)) before two dot products a row.
//
// How: per panel and block, `Q8_16::unpack_steps`' 16 steps each give rows 2v and 2v + 1
// of the block's levels (k = 2v, 2v + 1: both in one half of the block, so under one
// scale), 32 outputs each; a vpermb interleaves them to [output][2 k] bytes, whose halves
// widened to words and looked up are the pairs (bf16 level of k = 2v low, of k = 2v + 1
// high) of outputs 0-15 and 16-31. x is packed once per call in the same pairs. Each row
// sums a block's half (16 k) per output in float32, then adds it times the half's scale
// (code * super, exact as the exact kernel's): per output lane, one block half after
// another. Products of two bf16 values are exact in float32 and the sums float32, so
// the result is the exact kernel's arithmetic in another order within a half
// (vdpbf16ps adds its lane's k = 2v + 1 product, then k = 2v's, each rounded once), the
// sums rounded to bf16 once (vcvtneps2bf16).
// The row counts this path takes: gpu/cpu/routing.py (`BF16_DOT_MAX_ROWS`).
//
// Read-ahead: at one row a block's loads wait on memory unless asked for early, as in
// quant_linear_bf16.cpp: the levels, codes and supers `Q8_16::kReadAhead` blocks ahead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "entry_points.h"
#include "prefetch.h"
#include "q8_16_blocks.h"
#include "quant_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

using namespace quant;

constexpr int kMaxRows = 4;  // rows of x per call this kernel takes

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// bf16(l) for the 6 bits of a level l in [-32, 31] (two's complement): the words
// vpermt2w looks up with bits 0-5 of each index.
struct LevelTable {
  alignas(64) uint16_t words[64];
  LevelTable() {
    for (int i = 0; i < 64; ++i) {
      const float level = static_cast<float>(i < 32 ? i : i - 64);
      words[i] = c10::BFloat16(level).x;  // exact: small integers
    }
  }
};

// vpermb index: byte 2n <- byte n (row 2v, output n), byte 2n + 1 <- byte 32 + n (row
// 2v + 1, output n), for n < 32.
inline __m512i pair_index() {
  alignas(64) uint8_t idx[64];
  for (int n = 0; n < 32; ++n) {
    idx[2 * n] = static_cast<uint8_t>(n);
    idx[2 * n + 1] = static_cast<uint8_t>(32 + n);
  }
  return _mm512_load_si512(idx);
}

// T rows of x against panel p: xp [T][K/2] packed x pairs (row stride xs); out: T rows of
// the panel's outputs (row stride os), `cols` of them real.
template <int T>
inline void panel(const Q8_16& w, int64_t p, const uint32_t* xp, int64_t xs,
                  c10::BFloat16* out, int64_t os, int64_t cols) {
  static const LevelTable table;
  const __m512i lo_table = _mm512_load_si512(table.words),
                hi_table = _mm512_load_si512(table.words + 32);
  const __m512i pairs = pair_index();
  const int64_t blocks = w.K / kBlock;
  __m512 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = w.global(p, b);
    const uint8_t* src = w.qs + g * Q8_16::kPackedBytes;
    const int64_t ahead = g + Q8_16::kReadAhead;  // past the call's last block: harmless
    for (int64_t line = 0; line < Q8_16::kPackedBytes / 64; ++line)
      prefetch::t1(w.qs, ahead * Q8_16::kPackedBytes + 64 * line);
    prefetch::t1(w.codes, ahead * 2 * kPanel);
    prefetch::t1(w.supers, ahead / 8 * kPanel * 4);
    prefetch::t1(w.supers, ahead / 8 * kPanel * 4 + 64);
    const int8_t* codes = w.codes + 2 * g * kPanel;
    const float* supers = w.supers + (g / 8) * kPanel;
    __m512 sums[T][2];  // a block half's sums per row: outputs 0-15, 16-31
    for (int t = 0; t < T; ++t) sums[t][0] = sums[t][1] = _mm512_setzero_ps();
    Q8_16::unpack_steps(src, [&](int v, __m512i rows) {  // rows 2v, 2v + 1: k = 2v, 2v + 1
      // [n][2 k] bytes; each level's 6 bits (two's complement) are its table index.
      const __m512i paired = _mm512_permutexvar_epi8(pairs, rows);
      const __m512bh w0 = as_bh(_mm512_permutex2var_epi16(
          lo_table, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(paired)), hi_table));
      const __m512bh w1 = as_bh(_mm512_permutex2var_epi16(
          lo_table, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(paired, 1)), hi_table));
      for (int t = 0; t < T; ++t) {
        const __m512bh xv =
            as_bh(_mm512_set1_epi32(static_cast<int>(xp[t * xs + b * 16 + v])));
        sums[t][0] = _mm512_dpbf16_ps(sums[t][0], w0, xv);
        sums[t][1] = _mm512_dpbf16_ps(sums[t][1], w1, xv);
      }
      if (v % 8 == 7) {  // a block half done (k < 16, then k >= 16): times its scales
        const int h = v / 8;
        const __m512 s0 = Q8_16::scales16(codes + 32 * h, supers),
                     s1 = Q8_16::scales16(codes + 32 * h + 16, supers + 16);
        for (int t = 0; t < T; ++t) {
          acc[t][0] = _mm512_fmadd_ps(s0, sums[t][0], acc[t][0]);
          acc[t][1] = _mm512_fmadd_ps(s1, sums[t][1], acc[t][1]);
          sums[t][0] = sums[t][1] = _mm512_setzero_ps();
        }
      }
    });
  }
  store_bf16_panel<T>(acc, out, os, cols);
}

// x's rows as pairs of bf16 bits, x[2i] in the low half and x[2i + 1] in the high one
// (as the levels), [M][K/2].
void pack_x(const at::Tensor& x, std::vector<uint32_t>& xp) {
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0);
  const auto* bits = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  xp.resize(M * K / 2);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t i = 0; i < K / 2; ++i)
      xp[t * K / 2 + i] =
          bits[t * xs + 2 * i] | static_cast<uint32_t>(bits[t * xs + 2 * i + 1]) << 16;
}

}  // namespace

namespace kernels {

// x [M <= 4, K] bf16 @ W.T for the Q8_16 weight given by its levels, codes and supers
// (q8_16_blocks.h), N real outputs: bf16 [M, N] (entry_points.h: the fused decode call
// runs it without the dispatcher).
at::Tensor q8_16_linear_bf16(const at::Tensor& x, const at::Tensor& levels,
                             const at::Tensor& codes, const at::Tensor& supers, int64_t N) {
  const char* op = "q8_16_linear_bf16";
  const Q8_16 w = Q8_16::of(levels, codes, supers, op);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              op, ": x must be bfloat16 [M, K] with contiguous rows, got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(0) <= kMaxRows, op, ": x has ", x.size(0), " rows, at most ", kMaxRows);
  const int64_t panels = levels.size(0), K = w.K, M = x.size(0);
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  static thread_local std::vector<uint32_t> xp;
  pack_x(x, xp);
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  // ~64k weights per task at least, as quant_linear.cpp.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanel * K));
  const uint32_t* xp_ptr = xp.data();
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      with_rows<kMaxRows>(M, [&](auto T) {
        panel<decltype(T)::value>(w, p, xp_ptr, K / 2, out_ptr + p * kPanel, N,
                                  std::min(kPanel, N - p * kPanel));
      });
  });
  return out;
}

}  // namespace kernels

// Registered only where AVX512-BF16 and VBMI were compiled in: callers look it up by name.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q8_16_linear_bf16(Tensor x, Tensor levels, Tensor codes, Tensor supers, int N) -> Tensor");
  m.impl("q8_16_linear_bf16", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_16_linear_bf16));
}
#endif
