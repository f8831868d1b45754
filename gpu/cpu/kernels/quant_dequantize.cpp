// A GGUF weight's Q4_1 / Q8_0 blocks dequantized to float32 in one parallel pass.
//
// Why: a bf16 model on a CPU without bf16 arithmetic multiplies in float32
// (gpu/cpu/linear.py, `PackedLinear.widen`), so the load dequantizes every quantized
// weight to hand oneDNN's reorder its float32 values. In eager torch that is five passes
// over the weight (the nibbles split and joined, widened, scaled, offset), each writing
// a fresh tensor, a large share of a widened model's load. Here each weight is read once
// and written once, into `out`. (Writing every layer into one reused buffer instead of
// fresh tensors gains nothing: the page faults are not the cost.)
//
// Input: the GGUF's row order, as models/gguf_blocks.py keeps it: Q4_1 qweight [N, K/2]
// uint8 (per block of 32, byte j holds k = j in its low nibble and k = j + 16 in its
// high one), Q8_0 qweight [N, K] int8; scales (and mins) [N, K/32] float32.
//
// Exactness: gguf-py's numpy dequantizer in float32 — Q4_1 `d * q + m` (a multiply
// rounded, then an add rounded), Q8_0 `q * d` — so `out` is the float32 checkpoint's
// weight bit for bit. -ffp-contract=off (build.py) keeps the multiply and the add two
// roundings whatever the scales.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

void check(const at::Tensor& qweight, at::ScalarType qtype, int64_t per_block,
           const at::Tensor& scales, const at::Tensor& out, const char* op) {
  TORCH_CHECK(qweight.scalar_type() == qtype && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) % per_block == 0,
              op, ": qweight must be contiguous ", qtype, " [N, K/32 * ", per_block, "], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), blocks = qweight.size(1) / per_block;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == blocks,
              op, ": scales must be contiguous float32 [N, K/32] = [", N, ", ", blocks, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == N && out.size(1) == blocks * kBlock,
              op, ": out must be contiguous float32 [N, K] = [", N, ", ", blocks * kBlock,
              "], got ", out.scalar_type(), " ", out.sizes());
}

// ~64k weights per task at least: below that a thread's start costs more than it saves.
int64_t grain_rows(int64_t K) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)); }

void q4_1_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                     at::Tensor& out) {
  check(qweight, at::kByte, kBlock / 2, scales, out, "q4_1_dequantize");
  TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.is_contiguous() &&
                  mins.sizes() == scales.sizes(),
              "q4_1_dequantize: mins must be contiguous float32 shaped like scales ",
              scales.sizes(), ", got ", mins.scalar_type(), " ", mins.sizes());
  const int64_t blocks = scales.size(1), K = blocks * kBlock;
  const uint8_t* qs = qweight.const_data_ptr<uint8_t>();
  const float* d = scales.const_data_ptr<float>();
  const float* m = mins.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, qweight.size(0), grain_rows(K), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin * blocks; b < end * blocks; ++b) {
      const uint8_t* q = qs + b * (kBlock / 2);
      float* w = o + b * kBlock;
      const float scale = d[b], min = m[b];
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const float scaled_lo = scale * static_cast<float>(q[j] & 0x0F);
        const float scaled_hi = scale * static_cast<float>(q[j] >> 4);
        w[j] = scaled_lo + min;
        w[j + kBlock / 2] = scaled_hi + min;
      }
    }
  });
}

void q8_0_dequantize(const at::Tensor& qweight, const at::Tensor& scales, at::Tensor& out) {
  check(qweight, at::kChar, kBlock, scales, out, "q8_0_dequantize");
  const int64_t blocks = scales.size(1), K = blocks * kBlock;
  const int8_t* qs = qweight.const_data_ptr<int8_t>();
  const float* d = scales.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, qweight.size(0), grain_rows(K), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin * blocks; b < end * blocks; ++b) {
      const int8_t* q = qs + b * kBlock;
      float* w = o + b * kBlock;
      const float scale = d[b];
      for (int64_t j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]) * scale;
    }
  });
}

}  // namespace

// A fragment: paged_decode.cpp owns the library's one TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("q4_1_dequantize(Tensor qweight, Tensor scales, Tensor mins, Tensor(a!) out) -> ()");
  m.def("q8_0_dequantize(Tensor qweight, Tensor scales, Tensor(a!) out) -> ()");
  m.impl("q4_1_dequantize", c10::DispatchKey::CPU, TORCH_FN(q4_1_dequantize));
  m.impl("q8_0_dequantize", c10::DispatchKey::CPU, TORCH_FN(q8_0_dequantize));
}
