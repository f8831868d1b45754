// x @ W.T for a bf16 model's Q8_0 and Q8_16 blocks on AMX (the LM head of most GGUFs; a
// K-quant mix's Q6_K layers), straight from the blocks:
// bf16 x in, bf16 out, the products of bf16 values summed in fp32 by the tile unit.
//
// Why: on a CPU with AMX, oneDNN's packed bf16 matmul is fast at many rows, but every
// call streams the whole bf16 weight (2 bytes a weight) whatever the rows, so decode
// steps of a few to a few dozen rows wait on memory; the head's Q8_0 blocks are ~1.1
// bytes a weight. Each block of 32 outputs x 32 k is dequantized once per call into the
// tile unit's pair layout (2 KB of bf16), a few blocks ahead of the tile products that
// read it, its bytes prefetched further ahead still: into a ring of slots in L1 when
// one pass of at most 32 x rows covers the call, else two panels' worth in L2, the later
// passes of a panel (x rows past 32) reading what the first one widened. A Q8_0 block has
// 256 levels, too many for the table lookup of the Q4_1 layers
// (quant_linear_amx_table.cpp). The row counts this path takes: gpu/cpu/routing.py
// (`AMX_ROWS`).
//
// Exactness: each weight is dequantized as quant_blocks.h does (the float32 checkpoint's
// value) and rounded to bf16 to nearest even, as the bf16 checkpoint rounded it, so the
// products are oneDNN's on the bf16 weights; only the summation order differs.
//
// Layout: the tile unit multiplies pairs of k (its B operand holds, per row r and output
// n, the weights of k = 2r and 2r + 1). quant_blocks.h widens k = j with k = j + 16 (a
// Q4_1 byte's pairing, which Q8_0's widening shares), so the kernel pairs them so and
// permutes x to match once per call: x'[32b + 2j] = x[32b + j], x'[32b + 2j + 1] =
// x[32b + j + 16]. A dot product does not care in which order k comes.
//
// Tiles (all 8): C 0-3 (two x tiles of up to 16 rows x two output halves of 16),
// A 4-5 (x rows, one block of 32 k), B 6-7 (the block's weights for the two halves).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"
#include "entry_points.h"
#include "q8_16_blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

using namespace quant;

constexpr int kTileRows = 16;

using amx::permitted;
using amx::TileConfig;

// Tiles for x tiles of r0 and r1 rows (r1 may be 0).
void configure(int r0, int r1) {
  TileConfig c;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, kTileRows, kTileRows};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t] > 0 ? rows[t] : 1);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Two float vectors (outputs 0-15 of k = j and of k = j + 16) as one row of B: their
// bf16 values paired per output, rounded to nearest even.
// Lane i of a 32 x 16-bit vector from lane kPairs[i]: lanes 0-15 and 16-31 interleaved.
alignas(64) constexpr uint16_t kPairs[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                             21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                             11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

inline __m512i interleaved(__m512i v) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(kPairs), v);
}

inline void store_pair_row(__m512 lo, __m512 hi, uint16_t* row) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in 0-15, hi in 16-31
  _mm512_storeu_si512(row, interleaved(both));
}

// Block b of panel p as two B tiles: out[half][j][32 bf16] (2 KB).
template <typename W>
inline void dequantize_block(const W& w, int64_t p, int64_t b, uint16_t* out) {
  const auto bl = w.block(p, b);
  uint16_t* half1 = out + kTileRows * 32;
  for (int j = 0; j < 16; ++j) {
    __m512 lo0, lo1, hi0, hi1;
    W::widen(bl, j, lo0, lo1, hi0, hi1);
    store_pair_row(lo0, hi0, out + j * 32);
    store_pair_row(lo1, hi1, half1 + j * 32);
  }
}

// x [M, K] bf16 (row stride xs) with each block's k paired as B pairs them (see above).
std::unique_ptr<uint16_t[]> paired_x(const c10::BFloat16* x, int64_t M, int64_t xs,
                                     int64_t K) {
  std::unique_ptr<uint16_t[]> out(new uint16_t[M * K]);  // every word written below
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; k += kBlock)
      _mm512_storeu_si512(out.get() + i * K + k,
                          interleaved(_mm512_loadu_si512(x + i * xs + k)));
  return out;
}

// `rows` rows of a panel's fp32 sums (acc, 32 a row) into bf16 out (row stride N),
// the first `cols` outputs (the last panel may hold fewer than 32).
inline void store_rows(const float* acc, int rows, int64_t cols, c10::BFloat16* out,
                       int64_t N) {
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32   ? 0xFFFF
                       : cols <= 16 ? 0
                                    : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int i = 0; i < rows; ++i) {
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + i * kPanel));
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + i * kPanel + 16));
    _mm256_mask_storeu_epi16(out + i * N, m0, lo);
    _mm256_mask_storeu_epi16(out + i * N + 16, m1, hi);
  }
}

constexpr int64_t kSlot = 2 * kTileRows * 32;  // one block's two B tiles (uint16)
constexpr int64_t kAhead = 2;                   // blocks widened ahead of their products
constexpr int64_t kPrefetch = 8;                // blocks prefetched ahead of their widening

// The lines of global block g (panel-major, as the panels lie in memory) into L1: a call
// streams its blocks in that order, and the hardware's prefetchers alone leave the
// widening waiting on memory where a call's blocks are many (the LM head).
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}
inline void prefetch_block(const Q8_0& w, int64_t g) {
  prefetch_lines(w.qs + g * kBlock * kPanel, kBlock * kPanel);
  prefetch_lines(w.d + g * kPanel, kPanel * 4);
}
inline void prefetch_block(const Q8_16& w, int64_t g) {
  prefetch_lines(w.qs + g * Q8_16::kPackedBytes, Q8_16::kPackedBytes);
  prefetch_lines(w.codes + g * 2 * kPanel, 2 * kPanel);
  if (g % 8 == 0) prefetch_lines(w.supers + g / 8 * kPanel, kPanel * 4);
}

template <typename W>
void amx_linear(const W& w, const at::Tensor& x, int64_t N, at::Tensor& out) {
  const int64_t M = x.size(0), K = w.K, blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  const std::unique_ptr<uint16_t[]> xp =
      paired_x(x.const_data_ptr<c10::BFloat16>(), M, x.stride(0), K);
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  // Slot of block t (counted over a thread's panels): a ring when one pass covers the
  // rows; else two panels' worth, so a panel's blocks stay for its later passes while
  // the next panel's first ones are widened.
  const int64_t ring = M <= 2 * kTileRows ? 8 : 2 * blocks;
  const int64_t ahead = std::min(kAhead, blocks);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> storage;  // kept between calls: no fill per call
    const size_t need = ring * kSlot + 32;
    if (storage.size() < need) storage.resize(need);
    uint16_t* buf = reinterpret_cast<uint16_t*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    const int64_t total = (end - begin) * blocks;
    auto widen = [&](int64_t t) {
      if (t + kPrefetch < total) prefetch_block(w, begin * blocks + t + kPrefetch);
      if (t < total)
        dequantize_block(w, begin + t / blocks, t % blocks, buf + (t % ring) * kSlot);
    };
    for (int64_t t = 0; t < ahead; ++t) widen(t);
    alignas(64) float acc[2 * kTileRows][kPanel];
    int configured = -1;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel), t0 = (p - begin) * blocks;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
        const int r0 = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        const int r1 = static_cast<int>(std::min<int64_t>(kTileRows, M - m0 - r0));
        if (configured != r0 * 32 + r1) {
          configure(r0, r1);
          configured = r0 * 32 + r1;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (r1) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const uint16_t* a = xp.get() + m0 * K;
        for (int64_t b = 0; b < blocks; ++b) {
          if (m0 == 0) widen(t0 + b + ahead);
          const uint16_t* bb = buf + ((t0 + b) % ring) * kSlot;
          _tile_loadd(4, a + b * kBlock, K * 2);
          _tile_loadd(6, bb, 64);
          _tile_loadd(7, bb + kTileRows * 32, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (r1) {
            _tile_loadd(5, a + kTileRows * K + b * kBlock, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, &acc[0][0], kPanel * 4);
        _tile_stored(1, &acc[0][16], kPanel * 4);
        if (r1) {
          _tile_stored(2, &acc[kTileRows][0], kPanel * 4);
          _tile_stored(3, &acc[kTileRows][16], kPanel * 4);
        }
        store_rows(&acc[0][0], r0 + r1, cols, out_ptr + m0 * N + p * kPanel, N);
      }
    }
    _tile_release();
  });
}

// x, and a weight of `panels` panels (K = `K`) holding N.
void check_call(const char* op, const at::Tensor& x, int64_t panels, int64_t K, int64_t N) {
  TORCH_CHECK(permitted(), op, ": Linux refused this process the AMX state");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be bfloat16 [M, K] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
}

void check_scales(const char* op, const at::Tensor& scales, int64_t panels, int64_t K) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == panels &&
                  scales.size(1) == K / kBlock && scales.size(2) == kPanel,
              op, ": scales must be contiguous float32 [panels, K/32, 32]");
}

template <typename W>
at::Tensor linear_amx(const char* op, const at::Tensor& x, const W& w, int64_t panels,
                      int64_t N) {
  check_call(op, x, panels, w.K, N);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  amx_linear(w, x, N, out);
  return out;
}

at::Tensor q8_0_linear_amx(const at::Tensor& x, const at::Tensor& qweight,
                           const at::Tensor& scales, int64_t N) {
  const char* op = "q8_0_linear_amx";
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 4 &&
                  qweight.is_contiguous() && qweight.size(2) == kBlock &&
                  qweight.size(3) == kPanel,
              op, ": qweight must be contiguous int8 [panels, K/32, 32, 32]");
  const int64_t panels = qweight.size(0), K = qweight.size(1) * kBlock;
  check_scales(op, scales, panels, K);
  const Q8_0 w{qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), K};
  return linear_amx(op, x, w, panels, N);
}

}  // namespace

namespace kernels {

// entry_points.h: the fused decode call runs it without the dispatcher.
at::Tensor q8_16_linear_amx(const at::Tensor& x, const at::Tensor& levels,
                            const at::Tensor& codes, const at::Tensor& supers, int64_t N) {
  const Q8_16 w = Q8_16::of(levels, codes, supers, "q8_16_linear_amx");
  return linear_amx("q8_16_linear_amx", x, w, levels.size(0), N);
}

}  // namespace kernels

// Registered only where AMX was compiled in: callers look the ops up by name.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q8_0_linear_amx(Tensor x, Tensor qweight, Tensor scales, int N) -> Tensor");
  m.impl("q8_0_linear_amx", c10::DispatchKey::CPU, TORCH_FN(q8_0_linear_amx));
  m.def("q8_16_linear_amx(Tensor x, Tensor levels, Tensor codes, Tensor supers, int N) -> Tensor");
  m.impl("q8_16_linear_amx", c10::DispatchKey::CPU, TORCH_FN(kernels::q8_16_linear_amx));
  m.def("amx_usable() -> bool", &amx::permitted);
}
#endif
