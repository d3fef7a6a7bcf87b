/* cpu_activation.c's entry point (called by cpu_native.c's silu * up wrapper). */
#ifndef PDSERVE_CPU_ACTIVATION_H
#define PDSERVE_CPU_ACTIVATION_H

#include <stdint.h>

/* 1 when this CPU runs pd_silu_mul_bf16_avx2 (AVX2 + FMA, a cpuid check), else 0. */
int pd_silu_simd_supported(void);

/* cpu_native.c's pd_silu_mul_bf16 (same arguments) on AVX2 + FMA: out[r, i] =
 * bf16(bf16(silu(gate)) * up) with a vector exp; the caller has checked pd_silu_simd_supported(). */
void pd_silu_mul_bf16_avx2(const uint16_t *gu, long gu_stride, uint16_t *out, long rows, long inter);

#endif
