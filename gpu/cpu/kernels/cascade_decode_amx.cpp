// Cascade decode attention for a bf16 model on AMX: decode rows whose block tables begin
// with the same blocks (a chat's system prompt, held once by the prefix cache) attend to
// that shared prefix together, as one matmul on the tile unit, and to their own keys
// after it with vector code; the two partial results are merged by their log-sum-exp.
//
// Why: paged_decode.cpp walks each row's whole context, so R rows sharing a prefix read
// its keys and values R times and multiply them with fp32 vector FMAs, one query row at
// a time. Here the prefix's keys and values are packed once per KV head and every
// sharing row's query heads of that KV head (R x G rows) pass under them on the tile
// unit (benchmarks/cpu_cascade_ab.py times both kernels).
//
// Work units, taken from a shared counter by every thread (the two kinds differ in size):
//   prefix (KV head h, chunk c of the prefix's keys): the chunk's keys packed (kt, vp of
//     bf16_attention.h); s [R*G][keys] = q · kᵀ; each row's softmax over the chunk with
//     its maximum and sum, p split in two bf16 parts (softmax_split); o = p · v,
//     unnormalised, fp32. The prefix is cut into chunks so that there are units for
//     every thread and a chunk's scores stay in L2.
//   suffix (row i, KV head h): the row's keys [prefix, n) as paged_decode.cpp does them:
//     q scaled in fp32, scores, softmax with its maximum and sum, p·v unnormalised.
// Then per (row, query head): o = sum_c o_c e^(m_c - m) / sum_c s_c e^(m_c - m) over the
// partials c (the chunks and the suffix), m their largest maximum; fp32, rounded to bf16
// once.
//
// Layout: q and out [B, H, D] bf16 (any row/head stride, D contiguous); the pools bf16
// [kv_heads, num_slots, head_dim]; block_tables [B, max_blocks], context_lens [B] and
// rows [R] int32: the rows of q/out the call computes (others are left untouched), each
// with a context longer than `prefix` and the same first prefix / block_size table
// entries. D a multiple of 32. Registered only where AMX is compiled in.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "amx_attention.h"
#include "entry_points.h"
#include "fast_exp.h"
#include "paged.h"
#include "reduce.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

using namespace amx_attention;
using c10::BFloat16;

constexpr int64_t kScoreFloats = 1 << 15;  // a chunk's scores (rows x keys): 128 KB of L2

// scores [G][len] = qf [G][D] · each key of the row's run [first, n), qf already scaled.
void suffix_scores(const float* qf, const BFloat16* k, const int32_t* table, int64_t first,
                   int64_t n, int64_t block_size, int64_t G, int64_t D, float* scores) {
  const int64_t len = n - first;
  paged::for_each_run(k, D, table, first, n, block_size, [&](int64_t slot, int64_t at,
                                                              int64_t count) {
    const BFloat16* rows = k + slot * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float* out = scores + g * len + at;
      int64_t t = 0;
      for (; t + 4 <= count; t += 4) {  // four keys per q load
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const BFloat16* r = rows + t * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qg + d);
          a0 = _mm512_fmadd_ps(qv, paged::load16(r + d), a0);
          a1 = _mm512_fmadd_ps(qv, paged::load16(r + D + d), a1);
          a2 = _mm512_fmadd_ps(qv, paged::load16(r + 2 * D + d), a2);
          a3 = _mm512_fmadd_ps(qv, paged::load16(r + 3 * D + d), a3);
        }
        _mm_storeu_ps(out + t, reduce4(a0, a1, a2, a3));
      }
      for (; t < count; ++t) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), paged::load16(rows + t * D + d), a);
        out[t] = _mm512_reduce_add_ps(a);
      }
    }
  });
}

// 2^t for t <= 0 to about 1 ulp of fp32: t = n + f with n an integer and |f| <= 1/2, 2^f by
// its Taylor series to degree 6 (the next term is below 2e-7 of it), scalef multiplying
// by 2^n (0 far below the row's maximum). bf16_attention.h's exp2_nonpositive stops at
// degree 4, enough for p rounded once to bf16, not for p split in two (below).
inline __m512 exp2_fine(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);                 // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// p [W] = the softmax numerators of s [W] * scale over [0, len), 0 after, as two bf16
// rows: hi = p rounded to bf16, lo = the rest rounded to bf16, so that p·v on the tile
// unit as hi·v + lo·v carries p to about 16 significant bits (v is bf16, each product
// exact in fp32) where p rounded once to bf16 would keep 8 and move greedy ids. Returns
// the fp32 sum of p; the largest score in *top.
float softmax_split(const float* s, int64_t W, int64_t len, float scale, uint16_t* hi,
                    uint16_t* lo, float* top) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(mv);
  for (; j < len; ++j) m = std::max(m, s[j]);
  *top = m;
  // e^(scale (s - m)) = 2^(s k - m k), k = scale log2(e): one FMA a lane.
  const float k = scale * 1.44269504088896341f;
  const __m512 sc = _mm512_set1_ps(k), shift = _mm512_set1_ps(-m * k);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < W; j += 16) {
    const __mmask16 seen = j + 16 <= len ? 0xFFFF
                           : j >= len    ? 0
                                         : static_cast<__mmask16>((1u << (len - j)) - 1);
    const __m512 t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(seen, s + j), sc, shift);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp2_fine(_mm512_min_ps(t, _mm512_setzero_ps())));
    sum = _mm512_add_ps(sum, e);
    const __m256bh h = _mm512_cvtneps_pbh(e);
    const __m512 rest = _mm512_sub_ps(e, _mm512_cvtpbh_ps(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), (__m256i)h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), (__m256i)_mm512_cvtneps_pbh(rest));
  }
  return _mm512_reduce_add_ps(sum);
}

// Softmax numerators of one row of `len` scores in place; returns (max, sum).
std::pair<float, float> suffix_softmax(float* s, int64_t len) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(mv);
  for (; j < len; ++j) m = std::max(m, s[j]);
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb));
    _mm512_storeu_ps(s + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  float sum = _mm512_reduce_add_ps(sv);
  for (; t < len; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    sum += s[t];
  }
  return {m, sum};
}

void cascade(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& context_lens,
             const at::Tensor& rows_t, int64_t prefix, int64_t block_size, double scale,
             at::Tensor& out) {
  const int64_t R = rows_t.numel(), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), num_slots = k_cache.size(1), G = H / KVH;
  const int32_t* rows = rows_t.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t table_row = block_tables.stride(0);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.const_data_ptr<BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr<BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr<BFloat16>());
  BFloat16* out_ptr = out.mutable_data_ptr<BFloat16>();
  const int32_t* shared = tables + rows[0] * table_row;
  const float fscale = static_cast<float>(scale);

  // The prefix's chunks: at least one unit per thread, each chunk's scores within L2.
  const int64_t M = (R * G + kTile - 1) / kTile * kTile;
  const int64_t threads = at::get_num_threads();
  const int64_t widest = std::max<int64_t>(4 * kChunk, kScoreFloats / M / kChunk * kChunk);
  int64_t C = std::max((prefix + widest - 1) / widest, (threads + KVH - 1) / KVH);
  const int64_t chunk = ((prefix + C - 1) / C + kChunk - 1) / kChunk * kChunk;
  C = (prefix + chunk - 1) / chunk;

  // Partials: C chunks then the suffix, each [KVH][M][D] (row r of head h: row r / G of
  // `rows`, query head h * G + r % G) with their maxima and sums [KVH][M], in log units.
  const int64_t P = C + 1;
  // Kept between calls on the calling thread (every value read is written first): a
  // call's partials are then not fresh pages.
  // (Pointers: a thread_local named inside the workers' lambda would be each worker's own.)
  thread_local std::vector<float> o_buf, m_buf, s_buf;
  grow(o_buf, P * KVH * M * D);
  grow(m_buf, P * KVH * M);
  grow(s_buf, P * KVH * M);
  float* const part_o = o_buf.data();
  float* const part_m = m_buf.data();
  float* const part_s = s_buf.data();
  auto at_part = [&](int64_t c, int64_t h) { return (c * KVH + h) * M; };

  const int64_t prefix_units = KVH * C, units = prefix_units + R * KVH;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    configure();
    thread_local std::vector<uint16_t> qa, p, packed;
    thread_local std::vector<float> s, qf, acc, o_lo;
    for (int64_t u = next++; u < units; u = next++) {
      if (u < prefix_units) {
        const int64_t h = u / C, c = u % C;
        const int64_t c0 = c * chunk, c1 = std::min(prefix, c0 + chunk);
        const int64_t L = (c1 - c0 + kChunk - 1) / kChunk * kChunk;
        grow(qa, M * D);
        grow(p, 2 * M * L + kChunk);
        grow(packed, 2 * L * D);
        grow(s, M * L);
        uint32_t* kt = reinterpret_cast<uint32_t*>(packed.data());
        uint16_t* vp = packed.data() + L * D;
        pack(k_ptr + h * num_slots * D, v_ptr + h * num_slots * D, shared, c0, c1,
             block_size, D, L, kt, vp);
        for (int64_t r = 0; r < M; ++r) {
          uint16_t* dst = qa.data() + r * D;
          if (r < R * G) {
            const uint16_t* src = q_ptr + rows[r / G] * q.stride(0) + (h * G + r % G) * q.stride(1);
            std::copy(src, src + D, dst);
          } else {
            std::fill(dst, dst + D, uint16_t{0});
          }
        }
        if (D == 2 * kChunk || D == 4 * kChunk)
          matmul_held_b(qa.data(), D, kt, L, M, L, D, s.data(), L);
        else
          matmul(qa.data(), D, kt, L, M, L, D, s.data(), L);
        const int64_t at = at_part(c, h);
        uint16_t* p_lo = p.data() + M * L + kChunk;  // 64 bytes off hi's 4 KB alignment
        for (int64_t r = 0; r < M; ++r) {
          uint16_t* pr = p.data() + r * L;
          if (r >= R * G) {
            std::fill(pr, pr + L, uint16_t{0});
            std::fill(p_lo + r * L, p_lo + (r + 1) * L, uint16_t{0});
            continue;
          }
          float top;
          part_s[at + r] = softmax_split(s.data() + r * L, L, c1 - c0, fscale, pr,
                                         p_lo + r * L, &top);
          part_m[at + r] = top * fscale;
        }
        float* o = part_o + at * D;
        grow(o_lo, M * D);
        matmul(p.data(), L, reinterpret_cast<const uint32_t*>(vp), D, M, D, L, o, D);
        matmul(p_lo, L, reinterpret_cast<const uint32_t*>(vp), D, M, D, L, o_lo.data(), D);
        for (int64_t e = 0; e < M * D; e += 16)
          _mm512_storeu_ps(o + e, _mm512_add_ps(_mm512_loadu_ps(o + e),
                                                _mm512_loadu_ps(o_lo.data() + e)));
      } else {
        const int64_t i = (u - prefix_units) / KVH, h = (u - prefix_units) % KVH;
        const int64_t b = rows[i], n = lens[b], len = n - prefix;
        grow(qf, G * D);
        grow(acc, G * D);
        grow(s, G * len);
        for (int64_t g = 0; g < G; ++g) {
          const BFloat16* src = reinterpret_cast<const BFloat16*>(q_ptr) + b * q.stride(0) +
                                (h * G + g) * q.stride(1);
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d]) * fscale;
        }
        const int32_t* table = tables + b * table_row;
        const auto* k_head = reinterpret_cast<const BFloat16*>(k_ptr) + h * num_slots * D;
        const auto* v_head = reinterpret_cast<const BFloat16*>(v_ptr) + h * num_slots * D;
        suffix_scores(qf.data(), k_head, table, prefix, n, block_size, G, D, s.data());
        const int64_t at = at_part(C, h) + i * G;
        for (int64_t g = 0; g < G; ++g) {
          const auto [m, sum] = suffix_softmax(s.data() + g * len, len);
          part_m[at + g] = m;
          part_s[at + g] = sum;
        }
        paged::values_pass(s.data(), v_head, table, prefix, n, block_size, G, D, acc.data(),
                           len, 1);
        std::copy(acc.data(), acc.data() + G * D, part_o + at * D);
      }
    }
    _tile_release();
  });

  // The merge, on this thread: a few vectors per (row, query head), less than waking the
  // threads again would cost.
  std::vector<float> w(P);
  for (int64_t unit = 0; unit < R * KVH; ++unit) {
    const int64_t i = unit / KVH, h = unit % KVH;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < P; ++c) top = std::max(top, part_m[at_part(c, h) + r]);
      for (int64_t c = 0; c < P; ++c) {
        w[c] = std::exp(part_m[at_part(c, h) + r] - top);
        total += w[c] * part_s[at_part(c, h) + r];
      }
      BFloat16* dst = out_ptr + rows[i] * out.stride(0) + (h * G + g) * out.stride(1);
      for (int64_t d = 0; d < D; d += 16) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < P; ++c)
          a = _mm512_fmadd_ps(_mm512_set1_ps(w[c]),
                              _mm512_loadu_ps(part_o + (at_part(c, h) + r) * D + d), a);
        lanes::store16(dst + d, _mm512_mul_ps(a, _mm512_set1_ps(1.f / total)));
      }
    }
  }
}

}  // namespace

namespace kernels {

void cascade_decode_amx_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, const at::Tensor& rows,
                         int64_t prefix, int64_t block_size, double scale) {
  const char* op = "cascade_decode_amx_";
  TORCH_CHECK(amx::permitted(), op, ": Linux refused this process the AMX state");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() &&
                  out.stride(2) == 1, op, ": q and out must be [B, H, D] with contiguous D");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, op,
              ": q, out and the pools must be bfloat16");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2) &&
                  q.size(1) % k_cache.size(0) == 0, op,
              ": the pools must be contiguous [kv_heads, slots, head_dim] of q's head_dim "
              "and a divisor of its heads");
  TORCH_CHECK(q.size(2) % kChunk == 0, op, ": head_dim must be a multiple of 32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == q.size(0) &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0) && rows.scalar_type() == at::kInt &&
                  rows.is_contiguous() && rows.numel() >= 1, op,
              ": block_tables, context_lens (one int32 per row of q) and rows (int32)");
  TORCH_CHECK(prefix > 0 && block_size > 0 && prefix % block_size == 0 &&
                  prefix / block_size <= block_tables.size(1), op,
              ": the prefix must be whole blocks of the table, got ", prefix);
  const int32_t* r = rows.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t row = block_tables.stride(0), blocks = prefix / block_size;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < q.size(0) && lens[r[i]] > prefix &&
                    (lens[r[i]] + block_size - 1) / block_size <= block_tables.size(1), op,
                ": row ", r[i], " is out of range or its context is not past the prefix");
    TORCH_CHECK(std::equal(tables + r[i] * row, tables + r[i] * row + blocks, tables + r[0] * row),
                op, ": row ", r[i], " does not share the prefix's blocks");
  }
  cascade(q, k_cache, v_cache, block_tables, context_lens, rows, prefix, block_size, scale,
          out);
}

}  // namespace kernels

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("cascade_decode_amx_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, Tensor rows, int prefix, int block_size, "
        "float scale) -> ()");
  m.impl("cascade_decode_amx_", c10::DispatchKey::CPU, TORCH_FN(kernels::cascade_decode_amx_));
}
#endif
