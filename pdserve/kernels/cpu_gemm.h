/* cpu_gemm.c's entry points (called by cpu_native.c's Python wrappers). */
#ifndef PDSERVE_CPU_GEMM_H
#define PDSERVE_CPU_GEMM_H

#include <stdint.h>
#include <string.h>

/* bf16 <-> fp32: widening is exact (the bf16 bits are the fp32's high half); narrowing rounds to
 * nearest even, NaN to the canonical quiet NaN, as c10::BFloat16. */
static inline float pd_bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t pd_f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 1 when this CPU runs the vector kernel (AVX2 + FMA, by cpuid), 0: the scalar loop. */
int pd_gemm_simd(void);

/* packed := w ([n, k] row-major bf16) in the kernel's layout: ceil(n / 16) * 16 * k elements,
 * columns past n zero. */
void pd_gemm_pack(const uint16_t *w, long n, long k, uint16_t *packed);

/* out[r, c] = bf16(sum_i x[r, i] w[c, i] (+ bias[c])) for r < m, c < n; x rows of k bf16 with a
 * row stride, packed from pd_gemm_pack, bias fp32 or NULL. -1 when scratch memory is short. */
int pd_gemm_bf16w(const uint16_t *x, long x_stride, long m, long k, const uint16_t *packed, long n,
                  const float *bias, uint16_t *out, long out_stride);

#endif
