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
