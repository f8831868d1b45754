// The decoder's steps between matmuls on CPU, one pass each (models/ops.py's
// DecoderOps are the reference, same signatures).
//
// Why: eager torch runs the residual add and the RMSNorm as two ops, and SiLU-and-mul
// as two (plus the chunk view); a decode step at batch 16-64 is short enough that the
// ~90 extra dispatches and the temporaries they write are a visible share of it.
//
// add_rms_norm: residual += x (in place, rounded to the dtype as torch's add would),
// returns RMSNorm(residual) * weight, the sum of squares in fp32.
// silu_and_mul: gate_up [T, 2I] → SiLU(gate) * up [T, I], in fp32, rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "fast_exp.h"

namespace {

template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, float eps, int64_t rows,
                       int64_t n, int64_t x_row, int64_t r_row, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * x_row;
      T* ri = residual + i * r_row;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < n; ++j) {
        const T sum = T(static_cast<float>(ri[j]) + static_cast<float>(xi[j]));
        ri[j] = sum;
        const float s = static_cast<float>(sum);
        squares += s * s;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
      T* oi = out + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j)
        oi[j] = T(static_cast<float>(ri[j]) * inv * static_cast<float>(weight[j]));
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 &&
                  residual.stride(1) == 1 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "x and residual must be [T, N] with contiguous rows, weight [N]");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "x, residual and weight must share a dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows(x.const_data_ptr<float>(), residual.mutable_data_ptr<float>(),
                      weight.const_data_ptr<float>(), e, x.size(0), x.size(1), x.stride(0),
                      residual.stride(0), out.mutable_data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    add_rms_norm_rows(x.const_data_ptr<c10::BFloat16>(),
                      residual.mutable_data_ptr<c10::BFloat16>(),
                      weight.const_data_ptr<c10::BFloat16>(), e, x.size(0), x.size(1),
                      x.stride(0), residual.stride(0), out.mutable_data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "add_rms_norm takes float32 or bfloat16, got ", x.scalar_type());
  }
  return out;
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t inter, int64_t row_stride,
                   T* out) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gate_up + i * row_stride;
      const T* u = g + inter;
      T* o = out + i * inter;
#pragma omp simd
      for (int64_t j = 0; j < inter; ++j) {
        const float x = static_cast<float>(g[j]);
        const float e = exp_nonpositive(-std::fabs(x));  // sigmoid without overflow
        const float sigmoid = (x >= 0.f ? 1.f : e) / (1.f + e);
        o[j] = T(x * sigmoid * static_cast<float>(u[j]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows(gate_up.const_data_ptr<float>(), rows, inter, gate_up.stride(0),
                  out.mutable_data_ptr<float>());
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows(gate_up.const_data_ptr<c10::BFloat16>(), rows, inter, gate_up.stride(0),
                  out.mutable_data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "silu_and_mul takes float32 or bfloat16, got ", gate_up.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}
