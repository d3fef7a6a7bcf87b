/* cpu_attention.c's entry points (called by cpu_native.c's attention wrapper). */
#ifndef PDSERVE_CPU_ATTENTION_H
#define PDSERVE_CPU_ATTENTION_H

#include <stdint.h>

/* 1 when this CPU runs the AVX2 + FMA attention (x86-64, checked at run time with cpuid, so a
 * portable build carries it too), else 0. */
int pd_attention_simd_supported(void);

/* cpu_native.c's pd_attention_bf16 with the same arguments and result, on AVX2 + FMA; the caller
 * has checked pd_attention_simd_supported(), d % 16 == 0, d <= 512 and nh / nkv <= 64. */
int pd_attention_bf16_avx2(const uint16_t *q, const uint16_t *cache, long block_stride, long block_size,
                           long nkv, long d, const int32_t *block_tables, long bt_stride,
                           const int32_t *query_start, const int32_t *seq_lens, long batch, long nh,
                           float scale, uint16_t *out);

#endif
