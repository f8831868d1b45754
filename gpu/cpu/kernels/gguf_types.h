// Each GGUF type's block rewritten into a row of one of the kernels' three formats
// (gguf_repack.cpp runs them at load, rows in parallel).
//
// The rewrite is models/gguf_repack.py's, type by type (that module is the reference
// and documents each mapping; tests/test_gguf_types.py holds the two equal): Q4_0, Q4_1,
// Q4_K -> q4_1 (nibbles, float32 scale and minimum per 32); Q8_0, Q5_0, IQ4_NL, IQ4_XS
// -> q8_0 (int8, float32 scale per 32); Q6_K, Q3_K -> q8_16 (int8 levels in [-32, 31],
// per 16 an int8 scale code, per 256 a float32 super-block scale). Scales are the
// products gguf-py computes in float32 (an f16 times a small integer: exact; q8_16's
// multiplied where the kernels use them), so the weights the kernels compute are
// gguf-py's bit for bit.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifdef __SSE4_1__
#include <immintrin.h>
#endif

namespace gguf_types {

inline constexpr int kQK = 256;  // weights per K-quant super-block
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One output row's destination: levels (nibble bytes or int8), scales, mins (q4_1 only),
// and where asked a Q4_K's codes (per block its scale and min, per super-block d and
// -dmin: q4_1_scales.h). A q8_16 row has no float32 scales (d, m null): its codes are
// int8 per 16 weights, its supers one per 256.
struct Row {
  uint8_t* q;
  float* d;
  float* m;
  uint8_t* codes = nullptr;
  float* supers = nullptr;
};

// Per type: weights per block, bytes per block, kernel format, and the rewrite of one
// block into the row at block index b (its levels at q + b * level_bytes, scales at
// d + b * scales_per_block).
inline void q4_0(const uint8_t* x, Row r, int64_t b) {
  const float d = f16(x);
  std::memcpy(r.q + b * 16, x + 2, 16);
  r.d[b] = d;
  r.m[b] = d * -8.0f;
}

inline void q4_1(const uint8_t* x, Row r, int64_t b) {
  std::memcpy(r.q + b * 16, x + 4, 16);
  r.d[b] = f16(x);
  r.m[b] = f16(x + 2);
}

inline void q8_0(const uint8_t* x, Row r, int64_t b) {
  std::memcpy(r.q + b * 32, x + 2, 32);
  r.d[b] = f16(x);
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums, sub-block j of 8.
inline void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Four levels (bytes 0-15) as one 16-bit group of nibbles, byte i in nibble i.
inline uint32_t pack_nibbles(uint32_t bytes) {
  bytes = (bytes | (bytes >> 4)) & 0x00FF00FFu;
  return (bytes | (bytes >> 8)) & 0xFFFFu;
}

// Q4_K's levels of super-block b straight into the dot kernel's pairs (quant_linear_bf16.cpp
// `q4_1_dot_pairs`: per block and chunk c, k = 4c + i + 16 in the low half and k = 4c + i
// in the high one, nibble i), one output's dword every `stride` dwords: for a layer that
// keeps no panel levels, with no nibble-pair bytes in between. With SSE4.1 a sub-block's
// four dwords come from one byte shuffle: its 32 levels paired into 16 bytes (level 2i
// low, 2i + 1 high), dword c being pair bytes 8 + 2c, 9 + 2c, 2c, 2c + 1.
inline void q4_k_pairs(const uint8_t* x, int64_t b, uint32_t* out, int64_t stride) {
  const uint8_t* qs = x + 16;
#ifdef __SSE4_1__
  const __m128i nibble = _mm_set1_epi8(0x0F), low_byte = _mm_set1_epi16(0x00FF);
  const __m128i order = _mm_setr_epi8(8, 9, 0, 1, 10, 11, 2, 3, 12, 13, 4, 5, 14, 15, 6, 7);
  for (int s = 0; s < 8; ++s) {  // sub-block s = 2 * run + half: run's nibbles of one half
    const int run = s / 2, shift = 4 * (s % 2);
    const auto levels = [&](int at) {  // 16 levels of the sub-block, from byte `at`
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * run + at));
      return _mm_and_si128(_mm_srli_epi16(v, shift), nibble);
    };
    const auto pairs = [&](__m128i v) {  // 16 levels into 8 bytes, 2i | 2i + 1 << 4
      return _mm_and_si128(_mm_or_si128(v, _mm_srli_epi16(v, 4)), low_byte);
    };
    const __m128i dwords = _mm_shuffle_epi8(_mm_packus_epi16(pairs(levels(0)), pairs(levels(16))),
                                            order);
    uint32_t* o = out + (b * 8 + s) * 4 * stride;
    o[0] = static_cast<uint32_t>(_mm_cvtsi128_si32(dwords));
    o[stride] = static_cast<uint32_t>(_mm_extract_epi32(dwords, 1));
    o[2 * stride] = static_cast<uint32_t>(_mm_extract_epi32(dwords, 2));
    o[3 * stride] = static_cast<uint32_t>(_mm_extract_epi32(dwords, 3));
  }
#else
  for (int s = 0; s < 8; ++s) {
    const int run = s / 2, shift = 4 * (s % 2);
    for (int c = 0; c < 4; ++c) {
      uint32_t first, second;  // levels k = 4c .. 4c + 3 and k = 4c + 16 .. 4c + 19
      std::memcpy(&first, qs + 32 * run + 4 * c, 4);
      std::memcpy(&second, qs + 32 * run + 4 * c + 16, 4);
      out[((b * 8 + s) * 4 + c) * stride] = pack_nibbles((second >> shift) & 0x0F0F0F0Fu) |
                                            pack_nibbles((first >> shift) & 0x0F0F0F0Fu) << 16;
    }
  }
#endif
}

// Q4_K: levels into r.q where it is given (else only the scales and codes).
inline void q4_k(const uint8_t* x, Row r, int64_t b) {
  const float d = f16(x), dmin = f16(x + 2);
  const uint8_t* qs = x + 16;
  for (int s = 0; s < 8; ++s) {  // sub-block s = 2 * run + half: run's nibbles of one half
    const int run = s / 2, shift = 4 * (s % 2);
    uint8_t* out = r.q ? r.q + (b * 8 + s) * 16 : nullptr;
    for (int j = 0; j < 16 && out; ++j)
      out[j] = ((qs[32 * run + j] >> shift) & 0x0F) |
               (((qs[32 * run + 16 + j] >> shift) & 0x0F) << 4);
    int sc, mn;
    k_scale_min(x + 4, s, &sc, &mn);
    r.d[b * 8 + s] = d * static_cast<float>(sc);
    r.m[b * 8 + s] = -(dmin * static_cast<float>(mn));
    if (r.codes) {
      r.codes[(b * 8 + s) * 2] = static_cast<uint8_t>(sc);
      r.codes[(b * 8 + s) * 2 + 1] = static_cast<uint8_t>(mn);
    }
  }
  if (r.supers) {
    r.supers[b * 2] = d;
    r.supers[b * 2 + 1] = -dmin;
  }
}

inline void q5_0(const uint8_t* x, Row r, int64_t b) {
  uint32_t high;
  std::memcpy(&high, x + 2, 4);
  const uint8_t* low = x + 6;
  int8_t* out = reinterpret_cast<int8_t*>(r.q) + b * 32;
  for (int j = 0; j < 32; ++j) {
    const int nibble = j < 16 ? (low[j] & 0x0F) : (low[j - 16] >> 4);
    out[j] = static_cast<int8_t>((nibble | (((high >> j) & 1) << 4)) - 16);
  }
  r.d[b] = f16(x);
}

inline void iq4_levels(const uint8_t* qs, int8_t* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = kIq4Values[qs[j] & 0x0F];
    out[j + 16] = kIq4Values[qs[j] >> 4];
  }
}

inline void iq4_nl(const uint8_t* x, Row r, int64_t b) {
  iq4_levels(x + 2, reinterpret_cast<int8_t*>(r.q) + b * 32);
  r.d[b] = f16(x);
}

inline void iq4_xs(const uint8_t* x, Row r, int64_t b) {
  const float d = f16(x);
  uint16_t high;
  std::memcpy(&high, x + 2, 2);
  for (int s = 0; s < 8; ++s) {
    const int low = (x[4 + s / 2] >> (4 * (s % 2))) & 0x0F;
    const int scale = (low | (((high >> (2 * s)) & 3) << 4)) - 32;
    r.d[b * 8 + s] = d * static_cast<float>(scale);
    iq4_levels(x + 8 + 16 * s, reinterpret_cast<int8_t*>(r.q) + (b * 8 + s) * 32);
  }
}

inline void q6_k(const uint8_t* x, Row r, int64_t b) {
  const uint8_t *ql = x, *qh = x + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
  const float d = f16(x + 208);
  int8_t* out = reinterpret_cast<int8_t*>(r.q) + b * kQK;
  for (int n = 0; n < 2; ++n)      // two runs of 128 weights
    for (int g = 0; g < 4; ++g)    // four groups of 32 in each
      for (int j = 0; j < 32; ++j) {
        const int low = (ql[64 * n + 32 * (g % 2) + j] >> (4 * (g / 2))) & 0x0F;
        const int hi = (qh[32 * n + j] >> (2 * g)) & 3;
        out[128 * n + 32 * g + j] = static_cast<int8_t>((low | (hi << 4)) - 32);
      }
  std::memcpy(r.codes + b * 16, sc, 16);
  r.supers[b] = d;
}

inline void q3_k(const uint8_t* x, Row r, int64_t b) {
  const uint8_t *hmask = x, *qs = x + 32, *packed = x + 96;
  const float d = f16(x + 108);
  for (int i = 0; i < 16; ++i) {
    const int low = (packed[i % 8] >> (4 * (i / 8))) & 0x0F;
    const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    r.codes[b * 16 + i] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
  }
  r.supers[b] = d;
  int8_t* out = reinterpret_cast<int8_t*>(r.q) + b * kQK;
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 32; ++j) {
        const int low = (qs[32 * n + j] >> (2 * s)) & 3;
        const int bit = (hmask[j] >> (4 * n + s)) & 1;
        out[128 * n + 32 * s + j] = static_cast<int8_t>(low - ((bit ^ 1) << 2));
      }
}

struct Type {
  const char* name;
  int weights, bytes;  // per block
  const char* format;
  void (*rewrite)(const uint8_t*, Row, int64_t);
};

inline constexpr Type kTypes[] = {
    {"Q4_0", 32, 18, "q4_1", q4_0},     {"Q4_1", 32, 20, "q4_1", q4_1},
    {"Q8_0", 32, 34, "q8_0", q8_0},     {"Q4_K", kQK, 144, "q4_1", q4_k},
    {"Q5_0", 32, 22, "q8_0", q5_0},     {"IQ4_NL", 32, 18, "q8_0", iq4_nl},
    {"IQ4_XS", kQK, 136, "q8_0", iq4_xs}, {"Q6_K", kQK, 210, "q8_16", q6_k},
    {"Q3_K", kQK, 110, "q8_16", q3_k},
};

}  // namespace gguf_types
