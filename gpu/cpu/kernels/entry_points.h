// The C++ entry points of the kernels a fused caller (decode_layers.cpp) calls directly,
// each the function its registered op runs: the same code, without the dispatcher and
// the Python between them. Defined in the kernel's own file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kernels {

// decoder_ops.cpp; the `_out` forms write into `out` (contiguous, [T, dim]) instead.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void add_rms_norm_out(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                      double eps, at::Tensor& out);
void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out);

// rotary_kv_store.cpp
void rotary_kv_store_(at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping);

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t block_size, double scale,
                        int64_t window);
void paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t block_size, double scale, int64_t window, at::Tensor& out);

// quant_linear.cpp
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t N);
at::Tensor q8_16_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& codes,
                        const at::Tensor& supers, int64_t N);

#if (defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) || \
    (defined(__AVX2__) && defined(__FMA__))
#define KERNELS_INT8_LINEAR
// quant_linear_int8.cpp
at::Tensor q4_1_linear_int8(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scales, const at::Tensor& mins, int64_t N);
at::Tensor q8_16_linear_int8(const at::Tensor& x, const at::Tensor& levels,
                             const at::Tensor& codes, const at::Tensor& supers, int64_t N);
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KERNELS_Q4_1_LINEAR_BF16
// quant_linear_bf16.cpp
at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& qpairs,
                            const at::Tensor& scales, const at::Tensor& mins, int64_t N);
// quant_linear_bf16_q8_16.cpp
at::Tensor q8_16_linear_bf16(const at::Tensor& x, const at::Tensor& levels,
                             const at::Tensor& codes, const at::Tensor& supers, int64_t N);
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KERNELS_Q4_1_LINEAR_AMX
// quant_linear_amx_table.cpp
at::Tensor q4_1_linear_amx(const at::Tensor& x, const at::Tensor& qpairs,
                           const at::Tensor& scales, const at::Tensor& mins, int64_t N);
// quant_linear_amx.cpp
at::Tensor q8_16_linear_amx(const at::Tensor& x, const at::Tensor& levels,
                            const at::Tensor& codes, const at::Tensor& supers, int64_t N);
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KERNELS_CASCADE_DECODE_AMX
// cascade_decode_amx.cpp: the rows `rows` of out (the rows of q sharing the first `prefix`
// keys' blocks); the other rows of out are left as they were.
void cascade_decode_amx_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, const at::Tensor& rows,
                         int64_t prefix, int64_t block_size, double scale);
#endif

}  // namespace kernels
