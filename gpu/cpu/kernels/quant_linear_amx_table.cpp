// x @ W.T for a bf16 model's Q4_1 layers on AMX, the weights widened through a table per
// output and block: bf16 x in, bf16 out, the products of bf16 values summed in fp32.
//
// Why: a Q4_1 block gives each of its outputs only 16 distinct weights (d * q + m for
// the 16 levels q), so rather than widening every weight with a multiply-add and a
// rounding (quant_linear_amx.cpp, the Q8_0 LM head), the kernel rounds the 16 values
// of two outputs into one register and looks each output's 32 weights up with one
// vpermw: about half the instructions a weight, where widening, not the tile unit or
// memory, bounds a call of a few dozen rows. A lookup yields one output's weights along
// k, so the weights are the tile unit's A operand (16 outputs x 32 k), x^T its B
// operand (pairs of k x up to 16 x rows, transposed once per call) and each C tile
// (16 outputs x 16 x rows) is transposed on the way out.
//
// Exactness: the table holds d * q + m for q = 0..15 computed as quant_blocks.h widens
// a weight (one fused multiply-add: d * q is exact for f16 scales) and rounded to bf16
// to nearest even, as the bf16 checkpoint rounded it: the same bf16 weights as oneDNN
// multiplies; only the summation order differs.
//
// Layout: the bf16 dot kernel's (quant_linear_bf16.cpp, `PanelBlocks.dot_pairs`), so one
// copy of the levels serves both: per panel, block and chunk c < 4, one dword per output
// n, its low word holding k = 4c + i + 16 and its high word k = 4c + i in nibble i. Each
// half panel's four chunk vectors are transposed in registers into each output's 16 bytes
// (dword c of output n: bytes 4c..4c+3), and a lookup's index is one output's nibbles
// spread to words in k pair order: the tile unit's k pair r is k = r and k = r + 16, and
// x is permuted to match as it is transposed (x'[32b + 2j] = x[32b + j], x'[32b + 2j + 1]
// = x[32b + j + 16]), the pairing of quant_linear_amx.cpp, so both kernels sum a product
// in the same order. Scales and mins: float32, or a Q4_K's codes (q4_1_scales.h).
//
// Tiles (all 8): C 0-3 (outputs 0-15 and 16-31 x two x tiles of up to 16 rows), A 4-5
// (the two output halves' weights, one block), B 6-7 (the two x tiles' k pairs).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "amx.h"
#include "entry_points.h"
#include "prefetch.h"
#include "q4_1_scales.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

constexpr int kTile = 16;        // x rows per tile, outputs per A tile
constexpr int64_t kBlock = 32;   // k per Q4_1 block
constexpr int64_t kPanel = 32;   // outputs per panel
constexpr int64_t kPrefetch = 8; // blocks prefetched ahead of their widening

// Tiles for x tiles of r0 and r1 rows (r1 may be 0): the x rows are C's and B's columns.
void configure(int r0, int r1) {
  amx::TileConfig c;
  const int cols[8] = {r0, r0, r1, r1, 16, 16, r0, r1};  // 4-byte columns
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kTile;
    c.colsb[t] = static_cast<uint16_t>(4 * std::max(cols[t], 1));
  }
  _tile_loadconfig(&c);
}

// 16 x 16 32-bit lanes transposed in registers.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// Word i of a k pair's 32 words from word kPairs[i]: k = j and k = j + 16 side by side.
alignas(64) constexpr uint16_t kPairs[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                             21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                             11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
// Index word w of a lookup (k = w / 2, + 16 where w is odd) from an output's 16 bytes:
// word 2r (k = r = 4c + i) is in dword c's high word, word 2r + 1 (k = r + 16) in its low
// one, nibble i of each: byte kSpread[2w] (odd bytes zeroed by the mask), shifted right
// by kShift[w].
alignas(64) constexpr uint8_t kSpread[64] = {
    2,  0, 0,  0, 2,  0, 0,  0, 3,  0, 1,  0, 3,  0, 1,  0,   // c = 0
    6,  0, 4,  0, 6,  0, 4,  0, 7,  0, 5,  0, 7,  0, 5,  0,   // c = 1
    10, 0, 8,  0, 10, 0, 8,  0, 11, 0, 9,  0, 11, 0, 9,  0,   // c = 2
    14, 0, 12, 0, 14, 0, 12, 0, 15, 0, 13, 0, 15, 0, 13, 0};  // c = 3
alignas(64) constexpr uint16_t kShift[32] = {0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4,
                                             0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4};

// x [M, K] bf16 (row stride xs) as B tiles: per x tile t and block b, 16 rows (the k
// pairs r and r + 16 of the block) of 16 columns (the tile's x rows; zeros past M),
// 1 KB each.
std::unique_ptr<uint32_t[]> transposed_x(const c10::BFloat16* x, int64_t M, int64_t xs,
                                         int64_t K) {
  const int64_t tiles = (M + kTile - 1) / kTile, blocks = K / kBlock;
  const __m512i pairs = _mm512_load_si512(kPairs);
  // Every word is written below: no fill (new[] of ints leaves them as they are).
  std::unique_ptr<uint32_t[]> out(new uint32_t[tiles * blocks * kTile * kTile]);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 r[16];
      for (int i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        r[i] = row < M ? (__m512)_mm512_permutexvar_epi16(
                             pairs, _mm512_loadu_si512(x + row * xs + b * kBlock))
                       : _mm512_setzero_ps();
      }
      transpose16(r);
      float* dst = reinterpret_cast<float*>(out.get() + (t * blocks + b) * kTile * kTile);
      for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(dst + i * kTile, r[i]);
    }
  return out;
}

// The A tile of 16 outputs of one block: out[16][32] bf16, output n's weights along k.
// `q`: their chunk-0 dwords (chunk c at q + 32c); `d`, `m`: their scales and mins.
inline void widen16(const uint32_t* q, const float* d, const float* m, uint16_t* out) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Four chunk vectors (lane n: output n's dword c) transposed per 128-bit lane L:
  // bytes[j] lane L holds output 4L + j's four dwords, chunk by chunk.
  const __m512i c0 = _mm512_loadu_si512(q), c1 = _mm512_loadu_si512(q + kPanel);
  const __m512i c2 = _mm512_loadu_si512(q + 2 * kPanel), c3 = _mm512_loadu_si512(q + 3 * kPanel);
  const __m512i lo01 = _mm512_unpacklo_epi32(c0, c1), hi01 = _mm512_unpackhi_epi32(c0, c1);
  const __m512i lo23 = _mm512_unpacklo_epi32(c2, c3), hi23 = _mm512_unpackhi_epi32(c2, c3);
  const __m512i bytes[4] = {_mm512_unpacklo_epi64(lo01, lo23), _mm512_unpackhi_epi64(lo01, lo23),
                            _mm512_unpacklo_epi64(hi01, hi23), _mm512_unpackhi_epi64(hi01, hi23)};
  const __m512i spread = _mm512_load_si512(kSpread);
  const __m512i shifts = _mm512_load_si512(kShift);
  // The low 4 bits kept, and bit 4 choosing the second output's half of the table.
  const __m512i nibble = _mm512_set1_epi16(0x0F), second = _mm512_set1_epi16(0x10);
  constexpr __mmask64 kLow = 0x5555555555555555ull;
  for (int lane = 0; lane < 4; ++lane) {
    const __m512i at = _mm512_add_epi8(spread, _mm512_set1_epi8(static_cast<char>(16 * lane)));
    for (int j = 0; j < 4; j += 2) {
      const int n = 4 * lane + j;
      const __m512 t0 = _mm512_fmadd_ps(levels, _mm512_set1_ps(d[n]), _mm512_set1_ps(m[n]));
      const __m512 t1 =
          _mm512_fmadd_ps(levels, _mm512_set1_ps(d[n + 1]), _mm512_set1_ps(m[n + 1]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);  // n in 0-15, n + 1 in 16-31
      const __m512i b0 = _mm512_maskz_permutexvar_epi8(kLow, at, bytes[j]);
      const __m512i b1 = _mm512_maskz_permutexvar_epi8(kLow, at, bytes[j + 1]);
      const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi16(b0, shifts), nibble);
      const __m512i i1 =
          _mm512_ternarylogic_epi32(_mm512_srlv_epi16(b1, shifts), nibble, second, 0xEA);
      _mm512_store_si512(out + n * 32, _mm512_permutexvar_epi16(i0, table));
      _mm512_store_si512(out + (n + 1) * 32, _mm512_permutexvar_epi16(i1, table));
    }
  }
}

// C^T (16 outputs x up to 16 x rows, row stride ld floats) into `rows` rows of out
// (row stride N), the first `cols` of its 16 outputs.
inline void store_transposed(const float* acc, int ld, int rows, int64_t cols,
                             c10::BFloat16* out, int64_t N) {
  if (rows <= 0 || cols <= 0) return;
  __m512 r[16];
  for (int n = 0; n < kTile; ++n) r[n] = _mm512_load_ps(acc + n * ld);
  transpose16(r);
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int i = 0; i < rows; ++i)
    _mm256_mask_storeu_epi16(out + i * N, mask, (__m256i)_mm512_cvtneps_pbh(r[i]));
}

// Block g's lines into L1: its levels (8 lines), scales and mins (2 lines each; coded,
// a line of codes and a quarter of its super-block's four).
inline void prefetch_block(const uint32_t* q, const quant::Q4_1Scales& sc, int64_t g) {
  for (int64_t o = 0; o < kPanel * 16; o += 64) prefetch::t0(q, g * kPanel * 16 + o);
  if (sc.d == nullptr) {
    prefetch::t0(sc.codes, g * 64);
    prefetch::t0(sc.supers, g / 8 * 256 + g % 4 * 64);
    return;
  }
  for (const float* s : {sc.d, sc.m})
    for (int64_t o = 0; o < kPanel * 4; o += 64) prefetch::t0(s, g * kPanel * 4 + o);
}

// M rows of x (row stride xs) against every panel, into out_ptr's M rows.
void amx_rows(const c10::BFloat16* x, int64_t M, int64_t xs, const uint32_t* q,
              const quant::Q4_1Scales& sc, int64_t K, int64_t N, c10::BFloat16* out_ptr) {
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  const int64_t tiles = (M + kTile - 1) / kTile;
  const std::unique_ptr<uint32_t[]> xt = transposed_x(x, M, xs, K);
  constexpr int64_t kSlot = kPanel * 32;  // one block's A tiles (uint16)
  // A panel's blocks: a ring of slots in L1 where one pass of two x tiles covers the
  // rows, else the whole panel, widened in the first pass and read by the later ones.
  const int64_t ring = tiles <= 2 ? 4 : blocks;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> storage;  // kept between calls: no fill per call
    const size_t need = ring * kSlot + 32;
    if (storage.size() < need) storage.resize(need);
    uint16_t* buf = reinterpret_cast<uint16_t*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    alignas(64) float acc[kPanel][kPanel];  // [output][x row] of two x tiles
    int configured = -1;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      for (int64_t t = 0; t < tiles; t += 2) {
        const int r0 = static_cast<int>(std::min<int64_t>(kTile, M - t * kTile));
        const int r1 =
            t + 1 < tiles ? static_cast<int>(std::min<int64_t>(kTile, M - (t + 1) * kTile)) : 0;
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
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t g = p * blocks + b;  // the block's place in memory
          uint16_t* a = buf + (b % ring) * kSlot;
          if (t == 0) {
            if (g + kPrefetch < end * blocks) prefetch_block(q, sc, g + kPrefetch);
            alignas(64) float d[kPanel], m[kPanel];  // the block's scales and mins
            for (int h = 0; h < 2; ++h) {
              __m512 dv, mv;
              if (sc.d != nullptr)
                sc.load<false>(p, b, h, dv, mv);
              else
                sc.load<true>(p, b, h, dv, mv);
              _mm512_store_ps(d + 16 * h, dv);
              _mm512_store_ps(m + 16 * h, mv);
            }
            widen16(q + g * kPanel * 4, d, m, a);
            widen16(q + g * kPanel * 4 + 16, d + 16, m + 16, a + 16 * 32);
          }
          _tile_loadd(4, a, 64);
          _tile_loadd(5, a + 16 * 32, 64);
          _tile_loadd(6, xt.get() + (t * blocks + b) * kTile * kTile, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          if (r1) {
            _tile_loadd(7, xt.get() + ((t + 1) * blocks + b) * kTile * kTile, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, &acc[0][0], kPanel * 4);
        _tile_stored(1, &acc[16][0], kPanel * 4);
        if (r1) {
          _tile_stored(2, &acc[0][16], kPanel * 4);
          _tile_stored(3, &acc[16][16], kPanel * 4);
        }
        c10::BFloat16* o = out_ptr + t * kTile * N + p * kPanel;
        store_transposed(&acc[0][0], kPanel, r0, std::min<int64_t>(16, cols), o, N);
        store_transposed(&acc[16][0], kPanel, r0, cols - 16, o + 16, N);
        store_transposed(&acc[0][16], kPanel, r1, std::min<int64_t>(16, cols), o + kTile * N, N);
        store_transposed(&acc[16][16], kPanel, r1, cols - 16, o + kTile * N + 16, N);
      }
    }
    _tile_release();
  });
}

// x's transposed rows that every panel's passes read stay in L2 where they fit in
// kChunkBytes: rows in chunks of that many (at least kMinChunk, a multiple of two x
// tiles), each widening the panels again. Whole, a prompt's rows (1664 rows of K = 4096:
// 13 MB) come from L3 at every panel, and the tile unit waits on them; where even
// kMinChunk rows do not fit (an MLP's down projection, K = 14336), chunks would only add
// widening, and the rows go whole (`benchmarks/cpu_int8_rows_ab.py --rows 128,1664`).
constexpr int64_t kChunkBytes = int64_t{1} << 20, kMinChunk = 128;

void amx_linear(const at::Tensor& x, const uint32_t* q, const quant::Q4_1Scales& sc,
                int64_t K, int64_t N, at::Tensor& out) {
  const int64_t M = x.size(0), row_bytes = K * 2;
  const int64_t chunk = kMinChunk * row_bytes > kChunkBytes
                            ? M
                            : kChunkBytes / row_bytes / (2 * kTile) * (2 * kTile);
  const c10::BFloat16* x_ptr = x.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t c0 = 0; c0 < M; c0 += chunk)
    amx_rows(x_ptr + c0 * x.stride(0), std::min(chunk, M - c0), x.stride(0), q, sc, K, N,
             out_ptr + c0 * N);
}

}  // namespace

namespace kernels {

at::Tensor q4_1_linear_amx(const at::Tensor& x, const at::Tensor& qpairs,
                           const at::Tensor& scales, const at::Tensor& mins, int64_t N) {
  const char* op = "q4_1_linear_amx";
  TORCH_CHECK(amx::permitted(), op, ": Linux refused this process the AMX state");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be bfloat16 [M, K] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(qpairs.scalar_type() == at::kInt && qpairs.dim() == 4 && qpairs.is_contiguous() &&
                  qpairs.size(2) == 4 && qpairs.size(3) == kPanel,
              op, ": qpairs must be contiguous int32 [panels, K/32, 4, 32] (PanelBlocks.dot_pairs)");
  const int64_t panels = qpairs.size(0), K = qpairs.size(1) * kBlock;
  const quant::Q4_1Scales sc = quant::Q4_1Scales::of(scales, mins, panels, K, op);
  TORCH_CHECK(x.size(1) == K, op, ": x has K = ", x.size(1), " but the weight has K = ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, op, ": N = ", N,
              " does not fill ", panels, " panels of 32 outputs");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
  amx_linear(x, reinterpret_cast<const uint32_t*>(qpairs.const_data_ptr<int32_t>()), sc, K, N,
             out);
  return out;
}

}  // namespace kernels

// Registered only where AMX was compiled in: callers look the op up by name.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_linear_amx(Tensor x, Tensor qpairs, Tensor scales, Tensor mins, int N) -> Tensor");
  m.impl("q4_1_linear_amx", c10::DispatchKey::CPU, TORCH_FN(kernels::q4_1_linear_amx));
}
#endif
