// The LoRA delta of a linear for the few-row sequences of a step (decode rows): for each
// segment of rows that share an adapter slot, y[rows] += (x[rows] A_s^T) B_s^T, float32
// or bfloat16 tensors, float32 accumulation (gpu/lora.py plans the segments once per step).
//
// Why: in torch that is a gather, two matmuls and a scatter per adapter per linear, each
// tiny, so a decode step with many adapters ran thousands of dispatches (a bf16 matmul of
// a few rows costs oneDNN's set-up many times over its arithmetic). Here one call does
// every segment: A's rows are read once per block of rows of a segment (a dot product
// with each row's x), then B^T's rows once per block (a scaled add into each row's
// accumulators), and the sum is added to y once, rounded once to y's dtype.
//
// A fused linear's B^T is block-diagonal (q's ranks write only q's columns, k's only
// k's: models/lora.py), so the expand reads it by parts: per slot, up to P runs of rank
// rows (r0, r1) with the output columns (o0, o1) they write; the zeros around them are
// neither read nor multiplied.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "lanes.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 4;  // rows of a segment that share one pass over A and B^T

// xf[i] = x_i widened to float32, once per block (the shrink then reads it `rank` times).
template <typename T>
void widen(float* xf, const T* const* x, int64_t nrows, int64_t in) {
  for (int64_t i = 0; i < nrows; ++i) {
    int64_t k = 0;
#ifdef LANES_VECTORS
    for (; k + lanes::kLanes <= in; k += lanes::kLanes) {
      lanes::store(xf + i * in + k, lanes::load(x[i] + k));
    }
#endif
    for (; k < in; ++k) xf[i * in + k] = static_cast<float>(x[i][k]);
  }
}

// h[i * rank + j] = sum_k xf[i][k] * a[j][k] for the `nrows` rows of one block: each of
// A's rows is read once for all of them.
template <typename T>
void shrink(float* h, const float* xf, int64_t nrows, const T* a, int64_t rank, int64_t in) {
  for (int64_t j = 0; j < rank; ++j) {
    const T* aj = a + j * in;
    float sum[kBlock] = {};
    int64_t k = 0;
#ifdef LANES_VECTORS
    lanes::Vec acc[kBlock];
    for (int64_t i = 0; i < nrows; ++i) acc[i] = lanes::zero();
    for (; k + lanes::kLanes <= in; k += lanes::kLanes) {
      const lanes::Vec av = lanes::load(aj + k);
      for (int64_t i = 0; i < nrows; ++i) {
        acc[i] = lanes::fmadd(lanes::load(xf + i * in + k), av, acc[i]);
      }
    }
    for (int64_t i = 0; i < nrows; ++i) sum[i] = lanes::sum_lanes(acc[i]);
#endif
    for (; k < in; ++k) {
      const float av = static_cast<float>(aj[k]);
      for (int64_t i = 0; i < nrows; ++i) sum[i] += xf[i * in + k] * av;
    }
    for (int64_t i = 0; i < nrows; ++i) h[i * rank + j] = sum[i];
  }
}

// y[o] += sum_j h[j] * bt[j][o], j in [r0, r1), o in [o0, o1), for the `nrows` rows of
// one block (h: `rank` values per row): the accumulators stay in float32 until the one
// rounding into y.
template <typename T>
void expand(T* const* y, const float* h, int64_t nrows, const T* bt, int64_t rank,
            int64_t out, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  int64_t o = o0;
#ifdef LANES_VECTORS
  for (; o + lanes::kLanes <= o1; o += lanes::kLanes) {
    lanes::Vec acc[kBlock];
    for (int64_t i = 0; i < nrows; ++i) acc[i] = lanes::zero();
    for (int64_t j = r0; j < r1; ++j) {
      const lanes::Vec b = lanes::load(bt + j * out + o);
      for (int64_t i = 0; i < nrows; ++i) {
        acc[i] = lanes::fmadd(lanes::splat(h[i * rank + j]), b, acc[i]);
      }
    }
    for (int64_t i = 0; i < nrows; ++i) {
      lanes::store(y[i] + o, lanes::add(lanes::load(y[i] + o), acc[i]));
    }
  }
#endif
  for (; o < o1; ++o) {
    for (int64_t i = 0; i < nrows; ++i) {
      float acc = 0.f;
      for (int64_t j = r0; j < r1; ++j) {
        acc += h[i * rank + j] * static_cast<float>(bt[j * out + o]);
      }
      y[i][o] = static_cast<T>(static_cast<float>(y[i][o]) + acc);
    }
  }
}

template <typename T>
void delta(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt,
           const int64_t* order, const int64_t* starts, const int64_t* slots, int64_t groups,
           const int64_t* ranks, const int64_t* parts, int64_t P) {
  const int64_t in = x.size(1), out = y.size(1), R = A.size(1);
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = A.const_data_ptr<T>();
  const T* bp = Bt.const_data_ptr<T>();
  // Work units: (segment, block of up to kBlock of its rows), so a step of many
  // adapters, or of one adapter's many rows, spreads over the threads alike.
  std::vector<int64_t> unit_group, unit_first;
  for (int64_t g = 0; g < groups; ++g) {
    if (ranks[slots[g]] == 0) continue;
    for (int64_t r = starts[g]; r < starts[g + 1]; r += kBlock) {
      unit_group.push_back(g);
      unit_first.push_back(r);
    }
  }
  const int64_t units = static_cast<int64_t>(unit_group.size());
  at::parallel_for(0, units, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kBlock * R), xf(kBlock * in);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = unit_group[u], first = unit_first[u];
      const int64_t nrows = std::min(kBlock, starts[g + 1] - first);
      const int64_t s = slots[g], rank = ranks[s];
      const T* a = ap + s * R * in;
      const T* xrow[kBlock];
      T* yrow[kBlock];
      for (int64_t i = 0; i < nrows; ++i) {
        xrow[i] = xp + order[first + i] * xs;
        yrow[i] = yp + order[first + i] * ys;
      }
      widen(xf.data(), xrow, nrows, in);
      shrink(h.data(), xf.data(), nrows, a, rank, in);
      for (int64_t q = 0; q < P; ++q) {
        const int64_t* part = parts + (s * P + q) * 4;
        if (part[1] > part[0] && part[3] > part[2]) {
          expand(yrow, h.data(), nrows, bp + s * R * out, rank, out, part[0], part[1], part[2],
                 part[3]);
        }
      }
    }
  });
}

void lora_delta_(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt,
                 const at::Tensor& order, const at::Tensor& starts, const at::Tensor& slots,
                 const at::Tensor& ranks, const at::Tensor& parts) {
  const auto dt = y.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "lora_delta_: y must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == dt && A.scalar_type() == dt && Bt.scalar_type() == dt,
              "lora_delta_: x, A and Bt must have y's dtype");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1 &&
                  x.stride(1) == 1,
              "lora_delta_: y [T, out] and x [T, in] with unit column stride");
  TORCH_CHECK(A.dim() == 3 && Bt.dim() == 3 && A.is_contiguous() && Bt.is_contiguous() &&
                  A.size(0) == Bt.size(0) && A.size(1) == Bt.size(1) && A.size(2) == x.size(1) &&
                  Bt.size(2) == y.size(1),
              "lora_delta_: A [S, R, in] and Bt [S, R, out], contiguous");
  for (const at::Tensor* t : {&order, &starts, &slots, &ranks}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "lora_delta_: order, starts, slots and ranks must be 1-D int64");
  }
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 3 && parts.is_contiguous() &&
                  parts.size(0) == A.size(0) && parts.size(2) == 4,
              "lora_delta_: parts must be int64 [S, P, 4] (rank from, to; column from, to)");
  const int64_t groups = slots.size(0), P = parts.size(1);
  const int64_t* pt = parts.const_data_ptr<int64_t>();
  TORCH_CHECK(starts.size(0) == groups + 1 && ranks.size(0) == A.size(0),
              "lora_delta_: starts has one more entry than slots; ranks one per slot");
  const int64_t* st = starts.const_data_ptr<int64_t>();
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  const int64_t* rk = ranks.const_data_ptr<int64_t>();
  const int64_t* od = order.const_data_ptr<int64_t>();
  TORCH_CHECK(groups == 0 || (st[0] >= 0 && st[groups] <= order.size(0)),
              "lora_delta_: starts out of order's range");
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(st[g] <= st[g + 1] && sl[g] >= 0 && sl[g] < A.size(0) && rk[sl[g]] >= 0 &&
                    rk[sl[g]] <= A.size(1),
                "lora_delta_: a segment's bounds, slot or rank is out of range");
    for (int64_t q = 0; q < P; ++q) {
      const int64_t* part = pt + (sl[g] * P + q) * 4;
      TORCH_CHECK(part[0] >= 0 && part[1] <= rk[sl[g]] && part[2] >= 0 &&
                      part[3] <= y.size(1),
                  "lora_delta_: a part's ranks or columns are out of range");
    }
    for (int64_t r = st[g]; r < st[g + 1]; ++r) {
      TORCH_CHECK(od[r] >= 0 && od[r] < y.size(0), "lora_delta_: a row is out of range");
    }
  }
  if (dt == at::kFloat) {
    delta<float>(y, x, A, Bt, od, st, sl, groups, rk, pt, P);
  } else {
    delta<c10::BFloat16>(y, x, A, Bt, od, st, sl, groups, rk, pt, P);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ridgeline_cpu, m) {
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor A, Tensor Bt, Tensor order, "
        "Tensor starts, Tensor slots, Tensor ranks, Tensor parts) -> ()");
  m.impl("lora_delta_", c10::DispatchKey::CPU, TORCH_FN(lora_delta_));
}
