// Paged prefill attention for a bf16 model with bf16 products: paged_prefill.cpp's
// interface and result (the new tokens attend to their cached prefix and, causally, to
// themselves, read from the head-major pool), with q·k and p·v as bf16 products summed
// in fp32, as torch's own bf16 attention sums them: on the AMX tile unit
// (`paged_prefill_amx_`) or, on CPUs with AVX512-BF16 but no tile unit, by vdpbf16ps dot
// products (`paged_prefill_bf16_`).
//
// Why: paged_prefill.cpp computes the scores and p·v with fp32 vector FMAs. In a long
// prompt, and after a long cached prefix (a chat's system prompt), most of a prefill
// step's attention is those two products, and the tile unit multiplies bf16 several
// times faster than fp32 FMAs, vdpbf16ps twice the products of an FMA an instruction
// (benchmarks/cpu_prefill_ab.py times the kernels and torch's SDPA).
//
// Work unit: (sequence, KV head, a run of consecutive tiles of its new tokens):
//   1. the keys the run sees, [first, n), packed into the tile unit's B layout, which
//      pairs consecutive k: keys as kt [D/2][L] words (each word the key's dims 2i,
//      2i+1), values as vp [L/2][D] words (each word a dim of keys 2j, 2j+1); L is the
//      keys rounded up to 32, the rest zero. A run is all of a sequence's tiles unless
//      there are too few units for the threads, so keys are packed about once a call.
//   2. per tile: rows are the tile's tokens x the G query heads of that KV head (row r:
//      token r / G, head r % G), up to 64, padded to tiles of 16 with zero rows:
//        s [rows][keys] fp32 = q · kᵀ over the tile's keys (from the first key its first
//          token sees, rounded down to 32, to its last token's position + 1);
//        softmax along each row over the keys its token sees (causal, inside the
//          sliding window when one is set), fp32, scale applied here; p rounded to bf16,
//          keys it cannot see 0;
//        o [rows][D] fp32 = p · v, divided by the row's sum.
// The whole row of scores is kept (no running softmax): a tile's rows x its keys in
// fp32 and bf16, and the packed keys, in per-thread buffers kept between calls.
//
// The packing and row softmax are bf16_attention.h's, the products its `dot_matmul` or
// amx_attention.h's tile matmuls.
//
// Layout and limits: those of paged_prefill_ (q, out and the pools bf16), and D a
// multiple of 32 (a row of an A tile). Registered only where AVX512-BF16 (the dot
// products) or AMX (the tiles) is compiled in.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "amx_attention.h"
#include "bf16_attention.h"
#include "prefill_args.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kMaxRows = 64;  // query rows a work unit aims for (tokens x G)

using namespace bf16_attention;

// The two products by vdpbf16ps (bf16_attention.h).
struct DotProducts {
  static void begin() {}
  static void end() {}
  static void qk(const uint16_t* qa, int64_t D, const uint32_t* kt, int64_t L, int64_t M,
                 int64_t W, float* s) {
    dot_matmul(qa, D, kt, L, M, W, D, s, W);
  }
  static void pv(const uint16_t* p, int64_t W, const uint32_t* vp, int64_t D, int64_t M,
                 float* o) {
    dot_matmul(p, W, vp, D, M, D, W, o, D);
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The two products on the tile unit (amx_attention.h), which each thread configures.
struct TileProducts {
  static void begin() { amx_attention::configure(); }
  static void end() { _tile_release(); }
  static void qk(const uint16_t* qa, int64_t D, const uint32_t* kt, int64_t L, int64_t M,
                 int64_t W, float* s) {
    if (D == 2 * kChunk || D == 4 * kChunk)
      amx_attention::matmul_held_b(qa, D, kt, L, M, W, D, s, W);
    else
      amx_attention::matmul(qa, D, kt, L, M, W, D, s, W);
  }
  static void pv(const uint16_t* p, int64_t W, const uint32_t* vp, int64_t D, int64_t M,
                 float* o) {
    amx_attention::matmul(p, W, vp, D, M, D, W, o, D);
  }
};
#endif

template <typename Products>
void prefill_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& query_starts,
                  const at::Tensor& query_lens, const at::Tensor& context_lens,
                  int64_t block_size, double scale, int64_t window, at::Tensor& out) {
  const int64_t S = query_starts.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), num_slots = k_cache.size(1), G = H / KVH;
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  const int32_t* qlens = query_lens.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t table_row = block_tables.stride(0);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.const_data_ptr<c10::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr<c10::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr<c10::BFloat16>());
  c10::BFloat16* out_ptr = out.mutable_data_ptr<c10::BFloat16>();
  auto first_seen = [&](int64_t p) {
    return window > 0 ? std::max<int64_t>(0, p + 1 - window) : int64_t{0};
  };

  // Tiles of up to kMaxRows rows, a sequence's new tokens split evenly; a work unit is
  // (sequence, KV head, a run of its tiles), the runs short enough for some units per
  // thread (a long prompt alone in a step still takes every thread).
  struct Tile { int64_t i0, tq; };
  struct Unit { int64_t b, h, begin, end; };  // tiles [begin, end) of `tiles`
  if (S == 0) return;
  std::vector<Tile> tiles;
  std::vector<Unit> units;
  const int64_t most = std::max<int64_t>(1, kMaxRows / G);
  const int64_t runs = std::max<int64_t>(1, (4 * at::get_num_threads() + S * KVH - 1) / (S * KVH));
  for (int64_t b = 0; b < S; ++b) {
    if (qlens[b] == 0) continue;  // no new tokens: nothing to compute
    const int64_t count = (qlens[b] + most - 1) / most;
    const int64_t size = (qlens[b] + count - 1) / count, first = tiles.size();
    for (int64_t i0 = 0; i0 < qlens[b]; i0 += size)
      tiles.push_back({i0, std::min<int64_t>(size, qlens[b] - i0)});
    const int64_t n = static_cast<int64_t>(tiles.size()) - first;
    const int64_t parts = std::min(runs, n);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t r = 0; r < parts; ++r)
        units.push_back({b, h, first + n * r / parts, first + n * (r + 1) / parts});
  }
  const int64_t max_rows = (most * G + kTile - 1) / kTile * kTile;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    Products::begin();
    // Per thread, kept between calls: a call's buffers are then not fresh pages.
    thread_local std::vector<uint16_t> qa, p, packed;
    thread_local std::vector<float> s, o, sums;
    for (int64_t i = begin; i < end; ++i) {
      const Unit& u = units[i];
      const int64_t b = u.b, h = u.h, prefix = lens[b] - qlens[b];
      // The run's keys [first, n) packed, L of them (kt then vp).
      const int64_t first = first_seen(prefix + tiles[u.begin].i0);
      const int64_t n = prefix + tiles[u.end - 1].i0 + tiles[u.end - 1].tq;
      const int64_t L = (n - first + kChunk - 1) / kChunk * kChunk;
      grow(qa, max_rows * D);
      grow(p, max_rows * L);
      grow(packed, 2 * L * D);
      grow(s, max_rows * L);
      grow(o, max_rows * D);
      grow(sums, max_rows);
      uint32_t* kt = reinterpret_cast<uint32_t*>(packed.data());
      uint16_t* vp = packed.data() + L * D;
      pack(k_ptr + h * num_slots * D, v_ptr + h * num_slots * D, tables + b * table_row,
           first, n, block_size, D, L, kt, vp);
      for (int64_t ti = u.begin; ti < u.end; ++ti) {
        const Tile& t = tiles[ti];
        const int64_t rows = t.tq * G, M = (rows + kTile - 1) / kTile * kTile;
        const int64_t pos0 = prefix + t.i0;  // the tile's first token
        // Keys [ks, ks + W) of the packed ones; ks a multiple of 32 (a p·v chunk).
        const int64_t ks = (first_seen(pos0) - first) / kChunk * kChunk;
        const int64_t W = (pos0 + t.tq - first - ks + kChunk - 1) / kChunk * kChunk;
        for (int64_t r = 0; r < M; ++r) {
          uint16_t* dst = qa.data() + r * D;
          if (r < rows) {
            const uint16_t* src = q_ptr + (starts[b] + t.i0 + r / G) * q.stride(0) +
                                  (h * G + r % G) * q.stride(1);
            std::copy(src, src + D, dst);
          } else {
            std::fill(dst, dst + D, uint16_t{0});
          }
        }
        Products::qk(qa.data(), D, kt + ks, L, M, W, s.data());
        for (int64_t r = 0; r < M; ++r) {
          uint16_t* pr = p.data() + r * W;
          if (r >= rows) {
            std::fill(pr, pr + W, uint16_t{0});
            continue;
          }
          const int64_t pos = pos0 + r / G;
          sums[r] = softmax_row(s.data() + r * W, W, first_seen(pos) - first - ks,
                                pos + 1 - first - ks, static_cast<float>(scale), pr);
        }
        Products::pv(p.data(), W, reinterpret_cast<const uint32_t*>(vp) + ks / 2 * D, D, M,
                     o.data());
        for (int64_t r = 0; r < rows; ++r) {
          c10::BFloat16* dst = out_ptr + (starts[b] + t.i0 + r / G) * out.stride(0) +
                               (h * G + r % G) * out.stride(1);
          const lanes::Vec inv = lanes::splat(1.f / sums[r]);
          for (int64_t d = 0; d < D; d += kTile)
            lanes::store(dst + d, lanes::mul(lanes::load(o.data() + r * D + d), inv));
        }
      }
    }
    Products::end();
  });
}

// The checks both ops make, then the kernel with `Products`.
template <typename Products>
void paged_prefill_with(const char* op, at::Tensor& out, const at::Tensor& q,
                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& query_starts,
                        const at::Tensor& query_lens, const at::Tensor& context_lens,
                        int64_t block_size, double scale, int64_t window) {
  paged::check_prefill_args(out, q, k_cache, v_cache, block_tables, query_starts, query_lens,
                            context_lens, block_size);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16, op,
              ": q and the pools must be bfloat16");
  TORCH_CHECK(q.size(2) % kChunk == 0, op, ": head_dim must be a multiple of 32, got ",
              q.size(2));
  prefill_bf16<Products>(q, k_cache, v_cache, block_tables, query_starts, query_lens,
                         context_lens, block_size, scale, window, out);
}

void paged_prefill_bf16_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_starts, const at::Tensor& query_lens,
                         const at::Tensor& context_lens, int64_t block_size, double scale,
                         int64_t window) {
  paged_prefill_with<DotProducts>("paged_prefill_bf16_", out, q, k_cache, v_cache,
                                  block_tables, query_starts, query_lens, context_lens,
                                  block_size, scale, window);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void paged_prefill_amx_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& query_starts, const at::Tensor& query_lens,
                        const at::Tensor& context_lens, int64_t block_size, double scale,
                        int64_t window) {
  TORCH_CHECK(amx::permitted(), "paged_prefill_amx_: Linux refused this process the AMX state");
  paged_prefill_with<TileProducts>("paged_prefill_amx_", out, q, k_cache, v_cache,
                                   block_tables, query_starts, query_lens, context_lens,
                                   block_size, scale, window);
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  const char* args = "(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
                     "Tensor block_tables, Tensor query_starts, Tensor query_lens, "
                     "Tensor context_lens, int block_size, float scale, int window) -> ()";
  m.def((std::string("paged_prefill_bf16_") + args).c_str());
  m.impl("paged_prefill_bf16_", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_bf16_));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def((std::string("paged_prefill_amx_") + args).c_str());
  m.impl("paged_prefill_amx_", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_amx_));
#endif
}
#endif
