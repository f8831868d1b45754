// What the AMX kernels share (quant_linear_amx.cpp, paged_prefill_bf16.cpp): Linux's
// permission to use the tile state, and the tile configuration record.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux hands a process the AMX state only when asked (once per process; the grant
// covers every thread of it).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The record `_tile_loadconfig` reads: per tile, its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace amx
#endif
