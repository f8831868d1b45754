// Software prefetches the compiler cannot drop, at addresses formed as integers.
//
// Why asm: GCC 12 drops `_mm_prefetch` / `__builtin_prefetch` from some kernel loops
// altogether (quant_linear_amx_table.cpp's object had none of the prefetches its source
// asks for); an `asm volatile` instruction stays. Why integers: a read-ahead may name
// lines past the end of its tensor, where pointer arithmetic would be undefined; a
// prefetch never faults, so such a line costs at most a wasted fetch.
#pragma once

#include <cstdint>

namespace prefetch {

// The line at `base` + `offset` bytes, into L1 (t0) or L2 (t1).
inline void t0(const void* base, int64_t offset) {
  const auto* at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset);
  asm volatile("prefetcht0 %0" : : "m"(*at));
}
inline void t1(const void* base, int64_t offset) {
  const auto* at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + offset);
  asm volatile("prefetcht1 %0" : : "m"(*at));
}

}  // namespace prefetch
