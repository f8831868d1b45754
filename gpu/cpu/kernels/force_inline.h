// A helper that a kernel's inner loop calls once per block, inlined whatever GCC's
// heuristics say.
//
// Why: GCC leaves a header's `inline` member functions out of line where a file
// instantiates them from many kernels (quant_linear_bf16.cpp's eight panel variants
// called Q4_1Scales::load and read_ahead through the PLT). A call from a loop that
// holds its accumulators in vector registers spills them, and on AVX-512 the call's
// vzeroupper forces every live zmm register through memory, once per block.
#pragma once

#define RIDGELINE_INLINE inline __attribute__((always_inline))

// The other way round: `fn(args...)` in a function of its own whatever GCC's heuristics
// say, compiled apart from its caller's other work (quant_linear_int8.cpp's tiles of
// fewer rows than the most). The arguments are copied: a few pointers and counts.
template <typename Fn, typename... Args>
__attribute__((noinline)) void call_apart(const Fn& fn, Args... args) {
  fn(args...);
}
