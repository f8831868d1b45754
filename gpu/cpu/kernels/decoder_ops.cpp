// RMSNorm, the residual add joined to it, and SiLU-and-mul on CPU: one pass over each row.
//
// Why: in plain torch an RMSNorm is six ops (pow, mean, add, rsqrt, mul, mul, plus
// casts) and the residual add one more; each op is a dispatch and a trip through
// memory. At decode batch sizes the rows are tiny (SmolLM2: 576 floats), so the
// dispatches, not the arithmetic, are the norms' cost. Here each is one loop per row.
// Both dtypes run vector loops (lanes.h): in bf16, scalar conversions would make these
// loops several times slower than in float32.
//
// Semantics match models/ops.py (the reference): fp32 accumulation; in bf16 the
// residual sum is rounded to bf16 before it is normalised, as torch's `residual + x`
// would be. `add_rms_norm` updates `residual` in place (the DecoderOps contract
// allows it) and returns the normalised rows.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "entry_points.h"
#include "fast_exp.h"
#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// Rows per task: ~8K elements, so a decode batch of a few dozen rows splits over two
// threads (at::parallel_for splits a range evenly over the threads the grain allows).
// Single rows, and the few rows of a small batch, stay on the calling thread, where
// the fork and join would cost more than the work.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, (1 << 13) / width); }

// Vector loops for both dtypes (lanes.h); the scalar loops finish each row's tail.
#ifdef LANES_VECTORS
using lanes::add, lanes::load, lanes::mul, lanes::splat, lanes::store;
#endif

template <typename T>
void norm_rows(const T* in, int64_t in_stride, T* res, int64_t res_stride, const T* weight,
               T* out, int64_t rows, int64_t dim, float eps) {
#ifdef LANES_VECTORS
  const int64_t whole = dim - dim % lanes::kLanes;  // what the vector loops take
#endif
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * in_stride;
      T* o = out + r * dim;
      float ss = 0.f;
      int64_t d = 0;
      if (res != nullptr) {  // residual += x, the sum (as stored) normalised
        T* h = res + r * res_stride;
#ifdef LANES_VECTORS
        lanes::Vec acc = splat(0.f);
        for (; d < whole; d += lanes::kLanes) {
          store(h + d, add(load(h + d), load(x + d)));
          const lanes::Vec v = load(h + d);  // the sum as rounded to T
          acc = add(acc, mul(v, v));
        }
        ss = lanes::sum_lanes(acc);
#endif
        for (; d < dim; ++d) {
          const T sum = T(widen(h[d]) + widen(x[d]));
          h[d] = sum;
          const float v = widen(sum);
          ss += v * v;
        }
        x = h;
      } else {
#ifdef LANES_VECTORS
        lanes::Vec acc = splat(0.f);
        for (; d < whole; d += lanes::kLanes) {
          const lanes::Vec v = load(x + d);
          acc = add(acc, mul(v, v));
        }
        ss = lanes::sum_lanes(acc);
#endif
        for (; d < dim; ++d) ss += widen(x[d]) * widen(x[d]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      d = 0;
#ifdef LANES_VECTORS
      for (; d < whole; d += lanes::kLanes)
        store(o + d, mul(mul(load(x + d), splat(inv)), load(weight + d)));
#endif
      for (; d < dim; ++d) o[d] = T(widen(x[d]) * inv * widen(weight[d]));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows must be [T, dim], dim contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              name, ": weight must be [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight and rows differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " takes float32 or bfloat16");
}

// `out`: contiguous [rows of x, dim], x's dtype (the registered ops allocate it; a fused
// caller hands over a buffer it reuses).
void check_out(const at::Tensor& out, const at::Tensor& x, int64_t dim, const char* name) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == dim && out.scalar_type() == x.scalar_type(),
              name, ": out must be contiguous [T, ", dim, "] of x's dtype");
}

}  // namespace

namespace kernels {

void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, weight, "rms_norm");
  check_out(out, x, x.size(1), "rms_norm");
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        norm_rows<float>(x.const_data_ptr<float>(), x.stride(0), nullptr, 0,
                         weight.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                         x.size(0), x.size(1), static_cast<float>(eps));
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using T = c10::BFloat16;
        norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), nullptr, 0, weight.const_data_ptr<T>(),
                     out.mutable_data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
      }));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_out(x, weight, eps, out);
  return out;
}

void add_rms_norm_out(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                      double eps, at::Tensor& out) {
  check_rows(x, weight, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must match x");
  check_out(out, x, x.size(1), "add_rms_norm_");
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm_",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        norm_rows<float>(x.const_data_ptr<float>(), x.stride(0),
                         residual.mutable_data_ptr<float>(), residual.stride(0),
                         weight.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                         x.size(0), x.size(1), static_cast<float>(eps));
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using T = c10::BFloat16;
        norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), residual.mutable_data_ptr<T>(),
                     residual.stride(0), weight.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                     x.size(0), x.size(1), static_cast<float>(eps));
      }));
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps) {
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  add_rms_norm_out(x, residual, weight, eps, out);
  return out;
}

}  // namespace kernels

namespace {

// SiLU(g) * u = g * u / (1 + exp(-g)), the exp of -|g| (never overflows) on lanes.h's
// Vec by hand: GCC would not vectorise this loop written plainly (the select around the
// polynomial exp), and torch's two ops then beat it. Both dtypes take the vector
// path: the same operations in the same order as the scalar tail, so the same bits.
template <typename T>
void silu_mul_rows(const T* in, int64_t in_stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * in_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#ifdef LANES_VECTORS
      using lanes::Vec;
      const Vec one = splat(1.f), zero = lanes::zero();
      for (; i + lanes::kLanes <= inter; i += lanes::kLanes) {
        const Vec x = load(g + i);
        const lanes::Mask neg = lanes::less(x, zero);
        const Vec minus_abs = lanes::select(neg, x, lanes::sub(zero, x));
        const Vec e = exp_nonpositive(minus_abs);  // exp(-|x|)
        const Vec num = lanes::select(neg, e, one);  // x < 0: e, else 1
        const Vec sig = lanes::div(num, add(one, e));
        store(o + i, mul(mul(x, sig), load(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = widen(g[i]);
        const float e = exp_nonpositive(x < 0.f ? x : -x);
        const float sig = (x < 0.f ? e : 1.f) / (1.f + e);
        o[i] = T(x * sig * widen(u[i]));
      }
    }
  });
}

}  // namespace

namespace kernels {

void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [T, 2 * inter], rows contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  check_out(out, gate_up, inter, "silu_and_mul");
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_and_mul",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        silu_mul_rows<float>(gate_up.const_data_ptr<float>(), gate_up.stride(0),
                             out.mutable_data_ptr<float>(), gate_up.size(0), inter);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using T = c10::BFloat16;
        silu_mul_rows<T>(gate_up.const_data_ptr<T>(), gate_up.stride(0),
                         out.mutable_data_ptr<T>(), gate_up.size(0), inter);
      }));
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_out(gate_up, out);
  return out;
}

}  // namespace kernels

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(kernels::rms_norm));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(kernels::silu_and_mul));
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(kernels::add_rms_norm_));
}
