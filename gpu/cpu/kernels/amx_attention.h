// The tile-unit pieces of the bf16 attention kernels (paged_prefill_bf16.cpp's AMX
// variant, cascade_decode_amx.cpp): the tile configuration and the two matmuls over
// bf16_attention.h's packed keys and values (its packing and row softmax are this
// namespace's too).
//
// Tiles (all 16 rows x 64 bytes): p·v (and q·kᵀ at other D) in `matmul`: C 0-3 (up to
// four 16 x 16 fp32 results), A 4, B 6-7; q·kᵀ at D = 64 or 128 in `matmul_held_b`: the
// key tiles of a column block held in 4-7 while every row tile passes under them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "bf16_attention.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace amx_attention {

using namespace bf16_attention;

inline void configure() {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kTile;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// c [M][N] fp32 (row stride ldc floats) = a [M][K] bf16 (row stride lda) · b, where b is
// K/2 word rows of N columns (row stride ldb words); M, N multiples of 16, K of 32.
inline void matmul(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t M,
                   int64_t N, int64_t K, float* c, int64_t ldc) {
  for (int64_t m = 0; m < M; m += kTile) {
    for (int64_t n0 = 0; n0 < N; n0 += 4 * kTile) {
      const int64_t tiles = std::min<int64_t>(4, (N - n0) / kTile);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < K; k += kChunk) {
        _tile_loadd(4, a + m * lda + k, lda * 2);
        const uint32_t* bk = b + (k / 2) * ldb + n0;
        _tile_loadd(6, bk, ldb * 4);
        _tile_dpbf16ps(0, 4, 6);
        if (tiles > 1) {
          _tile_loadd(7, bk + kTile, ldb * 4);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (tiles > 2) {
          _tile_loadd(6, bk + 2 * kTile, ldb * 4);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (tiles > 3) {
          _tile_loadd(7, bk + 3 * kTile, ldb * 4);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      float* cm = c + m * ldc + n0;
      _tile_stored(0, cm, ldc * 4);
      if (tiles > 1) _tile_stored(1, cm + kTile, ldc * 4);
      if (tiles > 2) _tile_stored(2, cm + 2 * kTile, ldc * 4);
      if (tiles > 3) _tile_stored(3, cm + 3 * kTile, ldc * 4);
    }
  }
}

// matmul for K = 64 (N a multiple of 32: two column tiles, C 0-1, A 2-3) or 128 (one, C 0,
// A 1-3): a column block's B tiles are held in 4-7 while every m-tile passes under them,
// so b, the larger operand, is read once rather than M/16 times.
inline void matmul_held_b(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                          int64_t M, int64_t N, int64_t K, float* c, int64_t ldc) {
  if (K == 2 * kChunk) {
    for (int64_t n0 = 0; n0 < N; n0 += 2 * kTile) {
      _tile_loadd(4, b + n0, ldb * 4);
      _tile_loadd(5, b + kTile * ldb + n0, ldb * 4);
      _tile_loadd(6, b + n0 + kTile, ldb * 4);
      _tile_loadd(7, b + kTile * ldb + n0 + kTile, ldb * 4);
      for (int64_t m = 0; m < M; m += kTile) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, a + m * lda, lda * 2);
        _tile_loadd(3, a + m * lda + kChunk, lda * 2);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 6);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 3, 7);
        _tile_stored(0, c + m * ldc + n0, ldc * 4);
        _tile_stored(1, c + m * ldc + n0 + kTile, ldc * 4);
      }
    }
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += kTile) {  // K == 4 * kChunk
    _tile_loadd(4, b + n0, ldb * 4);
    _tile_loadd(5, b + kTile * ldb + n0, ldb * 4);
    _tile_loadd(6, b + 2 * kTile * ldb + n0, ldb * 4);
    _tile_loadd(7, b + 3 * kTile * ldb + n0, ldb * 4);
    for (int64_t m = 0; m < M; m += kTile) {
      _tile_zero(0);
      _tile_loadd(1, a + m * lda, lda * 2);
      _tile_loadd(2, a + m * lda + kChunk, lda * 2);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(3, a + m * lda + 2 * kChunk, lda * 2);
      _tile_dpbf16ps(0, 2, 5);
      _tile_loadd(1, a + m * lda + 3 * kChunk, lda * 2);
      _tile_dpbf16ps(0, 3, 6);
      _tile_dpbf16ps(0, 1, 7);
      _tile_stored(0, c + m * ldc + n0, ldc * 4);
    }
  }
}

}  // namespace amx_attention
#endif
