// A GGUF tensor's blocks rewritten into one of the kernels' three formats, at load.
//
// Why here and not only in numpy: a GGUF is served from its own file (no converted copy
// on disk), so every start rewrites every kept weight, and numpy's whole-array passes
// (a temporary per shift and mask) took seconds a gigabyte. This reads each block once
// and writes its levels and scales once, rows in parallel.
//
// Each type's rewrite of a block: gguf_types.h (models/gguf_repack.py is the reference).
//
// `source_rows` (optional, int64 [N]): output row r is the GGUF's row source_rows[r]
// (llama.cpp's Q/K rotary interleave undone as the rows are written).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gguf_types.h"

namespace {

using namespace gguf_types;

const Type& find_type(const std::string& name, const at::Tensor& raw, const char* op) {
  const Type* type = nullptr;
  for (const Type& t : kTypes)
    if (name == t.name) type = &t;
  TORCH_CHECK(type != nullptr, op, ": no rewrite for GGUF type ", name);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() &&
                  raw.size(1) % type->bytes == 0,
              op, ": raw must be contiguous uint8 [rows, blocks * ", type->bytes, "], got ",
              raw.scalar_type(), " ", raw.sizes());
  return *type;
}

const int64_t* row_order(const std::optional<at::Tensor>& source_rows, int64_t N,
                         const char* op) {
  if (!source_rows.has_value()) return nullptr;
  const at::Tensor& rows = *source_rows;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == N,
              op, ": source_rows must be contiguous int64 [", N, "]");
  const int64_t* order = rows.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(order[r] >= 0 && order[r] < N, op, ": source row out of range");
  return order;
}

bool is(const Type& type, const char* format) { return std::string(type.format) == format; }

// Bytes of levels and count of scales per row of a K-wide weight in `type`'s format.
int64_t level_bytes(const Type& type, int64_t K) { return is(type, "q4_1") ? K / 2 : K; }
int64_t scale_count(const Type& type, int64_t K) { return K / (is(type, "q8_16") ? 16 : 32); }

// A q8_16 block's 32 int8 levels (in [-32, 31]) packed to 6 bits, the panels' layout
// (q8_16_blocks.h): with u = level + 32, bytes j < 16 hold u[j]'s low 4 bits and
// u[j + 16]'s in the high nibble, bytes 16 + i (i < 8) the top 2 bits of u[i + 8f] at
// bits 2f (f < 4).
constexpr int64_t kPacked6 = 24;  // bytes per 32 levels
void pack6(const int8_t* levels, uint8_t* out) {
  uint8_t u[32];
  for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(levels[j] + 32);
  for (int j = 0; j < 16; ++j) out[j] = (u[j] & 0x0F) | ((u[j + 16] & 0x0F) << 4);
  for (int i = 0; i < 8; ++i) {
    uint8_t high = 0;
    for (int f = 0; f < 4; ++f) high |= (u[i + 8 * f] >> 4) << (2 * f);
    out[16 + i] = high;
  }
}

void check_out(const at::Tensor& t, at::ScalarType dtype, std::vector<int64_t> shape,
               const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
              "gguf_repack_panels_: ", what, " must be contiguous ", dtype, " ",
              at::IntArrayRef(shape), ", got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

namespace kernels {

// raw: uint8 [N_source, bytes per row], the tensor as the GGUF stores it. Returns
// [qweight, scales, mins]: q4_1's float32 scales and mins; q8_0's float32 scales (mins
// empty); q8_16's int8 scale codes and, in the third place, its float32 supers.
std::vector<at::Tensor> gguf_repack(const std::string& type_name, const at::Tensor& raw,
                                    const std::optional<at::Tensor>& source_rows) {
  const Type& type = find_type(type_name, raw, "gguf_repack");
  const int64_t N = raw.size(0), blocks = raw.size(1) / type.bytes;
  const int64_t K = blocks * type.weights;
  const int64_t* order = row_order(source_rows, N, "gguf_repack");
  const bool nibbles = is(type, "q4_1"), coded = is(type, "q8_16");
  auto bytes = raw.options();
  at::Tensor q = at::empty({N, level_bytes(type, K)},
                           bytes.dtype(nibbles ? at::kByte : at::kChar));
  at::Tensor d = at::empty({N, scale_count(type, K)}, bytes.dtype(coded ? at::kChar : at::kFloat));
  at::Tensor m = at::empty(nibbles ? d.sizes() : coded ? at::IntArrayRef{N, K / kQK}
                                                       : at::IntArrayRef{0},
                           bytes.dtype(at::kFloat));
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  uint8_t* qp = static_cast<uint8_t*>(q.mutable_data_ptr());
  void* dp = d.mutable_data_ptr();
  float* mp = m.numel() ? m.mutable_data_ptr<float>() : nullptr;
  const int64_t q_row = q.size(1), d_row = d.size(1), m_row = m.numel() ? m.size(1) : 0;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = src + (order ? order[r] : r) * raw.size(1);
      const Row out = coded ? Row{qp + r * q_row, nullptr, nullptr,
                                  static_cast<uint8_t*>(dp) + r * d_row, mp + r * m_row}
                            : Row{qp + r * q_row, static_cast<float*>(dp) + r * d_row,
                                  mp ? mp + r * m_row : nullptr};
      for (int64_t b = 0; b < blocks; ++b) type.rewrite(row + b * type.bytes, out, b);
    }
  });
  return {q, d, m};
}

namespace {

// 8 rows of 8 bytes transposed in place: x[i] holds row i (byte j in bits 8j..8j+7) and
// ends holding byte i of every row. Three rounds of swapping the off-diagonal halves
// (32-bit, 16-bit, then 8-bit blocks), as in Hacker's Delight.
inline void transpose8x8(uint64_t x[8]) {
  for (int i = 0; i < 4; ++i) {
    const uint64_t t = ((x[i] >> 32) ^ x[i + 4]) & 0x00000000FFFFFFFFull;
    x[i] ^= t << 32;
    x[i + 4] ^= t;
  }
  for (int i : {0, 1, 4, 5}) {
    const uint64_t t = ((x[i] >> 16) ^ x[i + 2]) & 0x0000FFFF0000FFFFull;
    x[i] ^= t << 16;
    x[i + 2] ^= t;
  }
  for (int i : {0, 2, 4, 6}) {
    const uint64_t t = ((x[i] >> 8) ^ x[i + 1]) & 0x00FF00FF00FF00FFull;
    x[i] ^= t << 8;
    x[i + 1] ^= t;
  }
}

// A panel's 32 rows of `cols` level bytes (row-major) into the panel layout, byte c of
// row n at panel[c * 32 + n]: eight bytes a store, where one store a byte was half a
// Q6_K tensor's rewrite.
void transpose_panel(const uint8_t* rows, int64_t cols, uint8_t* panel) {
  for (int64_t c0 = 0; c0 < cols; c0 += 8)
    for (int64_t n0 = 0; n0 < 32; n0 += 8) {
      uint64_t x[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&x[i], rows + (n0 + i) * cols + c0, 8);
      transpose8x8(x);
      for (int j = 0; j < 8; ++j) std::memcpy(panel + (c0 + j) * 32 + n0, &x[j], 8);
    }
}

// A Q4_K panel whose layer keeps only the dot pairs, the codes and the supers (where
// the dot, AMX or int8 kernels take its every call): super-block by super-block, its 32
// rows in turn, so that the stores of one super-block's pairs, codes and supers fill
// their lines one after another. Row by row (the general loop below), each store lands
// 128 bytes past the one before and a line is filled over 16 rows' passes. Rows from
// `rows` on are zeros; `block_bytes`: a Q4_K super-block's bytes in the file.
void q4_k_panel(const uint8_t* const* row_at, int64_t rows, int64_t K, int64_t block_bytes,
                uint32_t* dot, uint8_t* codes, float* supers) {
  for (int64_t b = 0; b < K / kQK; ++b)
    for (int64_t n = 0; n < 32; ++n) {
      uint8_t* c = codes + b * 16 * 32 + n;  // [blocks][2][32]: scale, then min
      float* s = supers + b * 2 * 32 + n;    // [super-blocks][2][32]: d, then -dmin
      if (n >= rows) {
        for (int i = 0; i < 8 * 4; ++i) dot[(b * 32 + i) * 32 + n] = 0;
        for (int i = 0; i < 16; ++i) c[i * 32] = 0;
        s[0] = s[32] = 0.0f;
        continue;
      }
      const uint8_t* x = row_at[n] + b * block_bytes;
      q4_k_pairs(x, b, dot + n, 32);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k_scale_min(x + 4, j, &sc, &mn);
        c[(2 * j) * 32] = static_cast<uint8_t>(sc);
        c[(2 * j + 1) * 32] = static_cast<uint8_t>(mn);
      }
      s[0] = f16(x);
      s[32] = -f16(x + 2);
    }
}

}  // namespace

// The same rewrite written straight into the kernels' panel layout (gpu/cpu/
// panel_blocks.py `PanelBlocks`: 32 output rows per panel, each level byte and scale
// column transposed so one load holds a column's 32 outputs), at global rows row0 ..
// row0 + N of tensors that may hold several weights stacked (q, k, v): one pass from the
// mapped file instead of a row-order copy, a stack and a transpose, each a fresh
// allocation. row0 must start a panel; rows past N in the last panel are zeros.
// levels: [P, level bytes, 32] (uint8 q4_1, int8 q8_0, uint8 q8_16 packed to 6 bits:
// `pack6`), or None where the layer keeps no panel levels; scales, mins: [P, scales, 32]
// float32 (mins None but for q4_1), or None where codes stand for them (always for
// q8_16); dot: q4_1's levels regrouped for the kernels that read them so (the bf16 dot
// product and the AMX tile kernel), [P, K/32, 4, 32] int32 (quant_linear_bf16.cpp
// `q4_1_dot_pairs`), or None. codes, supers: a Q4_K's own scale codes as those kernels
// read them (q4_1_scales.h), uint8 [P, K/32, 2, 32] and float32 [P, K/256, 2, 32]; a
// q8_16's, int8 [P, K/16, 32] and float32 [P, K/256, 32]; or None.
void gguf_repack_panels_(const std::string& type_name, const at::Tensor& raw,
                         const std::optional<at::Tensor>& source_rows,
                         const std::optional<at::Tensor>& levels,
                         const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins,
                         const std::optional<at::Tensor>& dot,
                         const std::optional<at::Tensor>& codes,
                         const std::optional<at::Tensor>& supers, int64_t row0) {
  const char* op = "gguf_repack_panels_";
  const Type& type = find_type(type_name, raw, op);
  const int64_t N = raw.size(0), blocks = raw.size(1) / type.bytes;
  const int64_t K = blocks * type.weights, cols = level_bytes(type, K);
  const bool nibbles = is(type, "q4_1"), coded = is(type, "q8_16");
  const bool is_q4_k = type_name == "Q4_K";
  // Bytes of a row's levels in the panel: q8_16's packed to 6 bits.
  const int64_t panel_cols = coded ? K / 32 * kPacked6 : cols;
  const std::optional<at::Tensor>* first =
      scales ? &scales : levels ? &levels : dot ? &dot : &codes;
  TORCH_CHECK(first->has_value(), op, ": nothing to write");
  const int64_t S = scale_count(type, K), P = (*first)->size(0);
  const int64_t* order = row_order(source_rows, N, op);
  TORCH_CHECK(row0 % 32 == 0 && row0 >= 0 && row0 + N <= P * 32,
              op, ": rows ", row0, "..", row0 + N, " do not fit ", P, " panels from a panel start");
  if (scales) check_out(*scales, at::kFloat, {P, S, 32}, "scales");
  TORCH_CHECK(mins.has_value() == (nibbles && scales.has_value()), op,
              ": mins come with q4_1's scales alone");
  if (mins) check_out(*mins, at::kFloat, {P, S, 32}, "mins");
  if (levels) check_out(*levels, is(type, "q8_0") ? at::kChar : at::kByte, {P, panel_cols, 32},
                       "levels");
  TORCH_CHECK(!dot || nibbles, op, ": the dot pairs are q4_1's alone");
  TORCH_CHECK(codes.has_value() == supers.has_value() &&
                  (!codes || type_name == "Q4_K" || coded) && (!coded || codes),
              op, ": codes and supers come together, from Q4_K or q8_16 (which has no others)");
  TORCH_CHECK(!coded || !scales, op, ": q8_16 has codes, not float32 scales");
  if (codes && coded) check_out(*codes, at::kChar, {P, K / 16, 32}, "codes");
  if (supers && coded) check_out(*supers, at::kFloat, {P, K / kQK, 32}, "supers");
  if (codes && !coded) check_out(*codes, at::kByte, {P, K / 32, 2, 32}, "codes");
  if (supers && !coded) check_out(*supers, at::kFloat, {P, K / kQK, 2, 32}, "supers");
  if (dot) check_out(*dot, at::kInt, {P, K / 32, 4, 32}, "dot");
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  uint8_t* lp = levels ? static_cast<uint8_t*>(levels->mutable_data_ptr()) : nullptr;
  float* sp = scales ? scales->mutable_data_ptr<float>() : nullptr;
  float* mp = mins ? mins->mutable_data_ptr<float>() : nullptr;
  uint32_t* dp = dot ? reinterpret_cast<uint32_t*>(dot->mutable_data_ptr<int32_t>()) : nullptr;
  uint8_t* cp = codes ? static_cast<uint8_t*>(codes->mutable_data_ptr()) : nullptr;
  float* up = supers ? supers->mutable_data_ptr<float>() : nullptr;
  // A row's codes and supers.
  const int64_t C = coded ? K / 16 : K / 32 * 2, U = coded ? K / kQK : K / kQK * 2;
  const int64_t panels = (N + 31) / 32;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // The levels of a panel's 32 rows, row by row, where they are kept (transposed into
    // the panel at its end), else of the one row in hand.
    std::vector<uint8_t> rows_q(lp ? 32 * cols : cols), packed(lp && coded ? 32 * panel_cols : 0);
    std::vector<float> d(S), m(nibbles ? S : 0), row_supers(cp ? U : 0);
    std::vector<uint8_t> row_codes(cp ? C : 0);
    for (int64_t local = begin; local < end; ++local) {
      const int64_t p = row0 / 32 + local;
      if (is_q4_k && dp && cp && !lp && !sp) {
        const uint8_t* row_at[32];
        for (int64_t n = 0; n < 32 && local * 32 + n < N; ++n) {
          const int64_t r = local * 32 + n;
          row_at[n] = src + (order ? order[r] : r) * raw.size(1);
        }
        q4_k_panel(row_at, std::min<int64_t>(32, N - local * 32), K, type.bytes,
                   dp + p * (K / 32) * 4 * 32, cp + p * C * 32, up + p * U * 32);
        continue;
      }
      for (int64_t n = 0; n < 32; ++n) {
        const int64_t r = local * 32 + n;
        uint8_t* q = rows_q.data() + (lp ? n * cols : 0);
        // A Q4_K row whose layer keeps only the pairs: written straight from the file.
        const bool direct = r < N && dp && !lp && is_q4_k;
        if (r < N) {
          const uint8_t* row = src + (order ? order[r] : r) * raw.size(1);
          const Row out{direct ? nullptr : q, coded ? nullptr : d.data(),
                        nibbles ? m.data() : nullptr, cp ? row_codes.data() : nullptr,
                        cp ? row_supers.data() : nullptr};
          for (int64_t b = 0; b < blocks; ++b) {
            type.rewrite(row + b * type.bytes, out, b);
            if (direct) q4_k_pairs(row + b * type.bytes, b, dp + p * (K / 32) * 4 * 32 + n, 32);
          }
        } else {  // the last panel's filling rows
          std::fill(q, q + cols, 0);
          std::fill(d.begin(), d.end(), 0.0f);
          std::fill(m.begin(), m.end(), 0.0f);
          std::fill(row_codes.begin(), row_codes.end(), 0);
          std::fill(row_supers.begin(), row_supers.end(), 0.0f);
        }
        if (cp) {
          for (int64_t i = 0; i < C; ++i) cp[(p * C + i) * 32 + n] = row_codes[i];
          for (int64_t i = 0; i < U; ++i) up[(p * U + i) * 32 + n] = row_supers[i];
        }
        if (sp)
          for (int64_t i = 0; i < S; ++i) sp[(p * S + i) * 32 + n] = d[i];
        if (mp)
          for (int64_t i = 0; i < S; ++i) mp[(p * S + i) * 32 + n] = m[i];
        if (dp && !direct)
          for (int64_t b = 0; b < K / 32; ++b)
            for (int c = 0; c < 4; ++c) {  // k = 4c + i + 16 in the low half, k = 4c + i high
              uint32_t low = 0, high = 0;
              for (int i = 0; i < 4; ++i) {
                const uint32_t v = q[b * 16 + 4 * c + i];
                low |= (v >> 4) << (4 * i);
                high |= (v & 0x0F) << (4 * i);
              }
              dp[((p * (K / 32) + b) * 4 + c) * 32 + n] = low | (high << 16);
            }
      }
      if (lp && coded) {
        for (int64_t n = 0; n < 32; ++n)
          for (int64_t b = 0; b < K / 32; ++b)
            pack6(reinterpret_cast<const int8_t*>(rows_q.data()) + n * cols + b * 32,
                  packed.data() + n * panel_cols + b * kPacked6);
        transpose_panel(packed.data(), panel_cols, lp + p * panel_cols * 32);
      } else if (lp) {
        transpose_panel(rows_q.data(), cols, lp + p * cols * 32);
      }
    }
  });
}

}  // namespace kernels

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("gguf_repack(str type_name, Tensor raw, Tensor? source_rows) -> Tensor[]");
  m.def("gguf_repack_panels_(str type_name, Tensor raw, Tensor? source_rows, "
        "Tensor(a!)? levels, Tensor(b!)? scales, Tensor(c!)? mins, Tensor(d!)? dot, "
        "Tensor(e!)? codes, Tensor(f!)? supers, int row0) -> ()");
  m.impl("gguf_repack", c10::DispatchKey::CPU, TORCH_FN(kernels::gguf_repack));
  m.impl("gguf_repack_panels_", c10::DispatchKey::CPU, TORCH_FN(kernels::gguf_repack_panels_));
}
