// exp for x <= 0, shared by the CPU kernels (softmax numerators, SiLU's sigmoid).
//
// Why not expf: libm's expf does not vectorise without -ffast-math (which would also
// change the semantics of everything else in the file). This is plain arithmetic, so
// a loop calling it vectorises: Cody-Waite range reduction and the classic degree-6
// single-precision polynomial, ~1 ulp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // 2^-126 is still a normal float: no denormal scale below
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#include "lanes.h"

#ifdef LANES_VECTORS
// exp_nonpositive on a vector (lanes.h: 16 lanes with AVX-512, 8 with AVX2), the same
// operations in the same order (so the same bits under -ffp-contract=off). Why by hand:
// GCC left the scalar loop unvectorised in the built library, and the softmax is the
// decode kernel's largest cost.
inline lanes::Vec exp_nonpositive(lanes::Vec x) {
  using lanes::add, lanes::mul, lanes::splat, lanes::Vec;
  x = lanes::max(x, splat(-87.0f));
  const Vec n = lanes::floor(add(mul(x, splat(1.44269504088896341f)), splat(0.5f)));
  const Vec r = add(lanes::sub(x, mul(n, splat(0.693359375f))), mul(n, splat(2.12194440e-4f)));
  Vec p = splat(1.9875691500e-4f);
  p = add(mul(p, r), splat(1.3981999507e-3f));
  p = add(mul(p, r), splat(8.3334519073e-3f));
  p = add(mul(p, r), splat(4.1665795894e-2f));
  p = add(mul(p, r), splat(1.6666665459e-1f));
  p = add(mul(p, r), splat(5.0000001201e-1f));
  p = add(add(mul(mul(p, r), r), r), splat(1.0f));
  return mul(p, lanes::pow2(n));
}
#endif
