/* A bf16-weight GEMM for CPUs without bf16 arithmetic (AVX2 hosts such as AMD Zen 3): the weight
 * stays bf16 in a packed layout, the products and sums are fp32 (FMA), the result is rounded to
 * bf16 once. torch's own bf16 GEMM on such a host is a generic loop at ~3 GFLOP/s, and oneDNN
 * refuses bf16 without AVX512-BF16 / AVX-NE-CONVERT (docs/benchmarks.md, "CPU engine on
 * SmolLM2-135M"); an fp32 copy of the weights would double their memory and the bytes a
 * one-row decode step reads.
 *
 * Packed weight (pd_gemm_pack): panels of 16 output columns, [N16 / 16][K][8] uint32 lanes; lane
 * j of row k of panel p holds W[16p + j, k] in its low and W[16p + 8 + j, k] in its high half.
 * One 256-bit load then widens to two fp32 vectors with a shift and a mask (bf16 -> fp32 is
 * exact: the bf16 bits are the fp32's high half).
 *
 * Kernel: a block of up to 6 rows x one panel: 12 accumulators, for each k one weight load, two
 * widening ops and 6 broadcasts feeding 12 FMAs. Rows go in chunks of ROW_CHUNK so that a panel
 * (16 x K x 2 bytes) stays in L1/L2 while the chunk's rows pass over it, and the next panel is
 * prefetched (a 56 MB LM head at 16 rows: 66 -> 72 GFLOP/s, 4 rows 43 -> 49). One thread.
 *
 * Built into every x86-64 module: the vector kernel carries target("avx2,fma") and runs only where
 * cpuid finds both (checked once), so a portable build (the container image's) uses it on such a
 * CPU and the scalar loop elsewhere.
 */
#include "cpu_gemm.h"

#include <stdlib.h>

#include "cpu_simd.h"

#define PANEL 16
#ifndef ROW_BLOCK
#define ROW_BLOCK 4
#endif
#define ROW_CHUNK 48

static int simd_state = -1; /* -1: not asked yet; else pd_avx2_fma_supported() */

int pd_gemm_simd(void) {
    if (simd_state < 0) simd_state = pd_avx2_fma_supported();
    return simd_state;
}

void pd_gemm_pack(const uint16_t *w, long n, long k, uint16_t *packed) {
    long panels = (n + PANEL - 1) / PANEL;
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++) {
            uint16_t *dst = packed + (p * k + i) * PANEL;
            for (long j = 0; j < PANEL / 2; j++) {
                long lo = p * PANEL + j, hi = lo + PANEL / 2;
                dst[2 * j] = lo < n ? w[lo * k + i] : 0;
                dst[2 * j + 1] = hi < n ? w[hi * k + i] : 0;
            }
        }
}

/* acc[r][0..15] (columns 16p + j: j < 8 in the low vector, j >= 8 in the high one) for rows
 * x[0..rows) of one panel; rows <= ROW_BLOCK, a compile-time constant after inlining. */
#if PD_X86
AVX2_INLINE void panel_block(const float *x, long k, const uint32_t *wp, int rows,
                                                              float *acc) {
    __m256 lo[ROW_BLOCK], hi[ROW_BLOCK];
    for (int r = 0; r < ROW_BLOCK; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    for (long i = 0; i < k; i++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(wp + i * (PANEL / 2)));
        /* the same row of the next panel (k rows on): it is streamed from memory once the layer
         * is past the caches; a prefetch never faults, so past the last panel is harmless */
        _mm_prefetch((const char *)(wp + (k + i) * (PANEL / 2)), _MM_HINT_T0);
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
        for (int r = 0; r < rows; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * k + i);
            lo[r] = _mm256_fmadd_ps(xb, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xb, w1, hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc + r * PANEL, lo[r]);
        _mm256_storeu_ps(acc + r * PANEL + 8, hi[r]);
    }
}
#endif

#if PD_X86
AVX2_FN static void panel_rows_avx2(const float *x, long k, const uint16_t *wpanel, int rows, float *acc) {
    const uint32_t *wp = (const uint32_t *)wpanel;
    switch (rows) {
#if ROW_BLOCK >= 6
        case 6: panel_block(x, k, wp, 6, acc); return;
#endif
#if ROW_BLOCK >= 5
        case 5: panel_block(x, k, wp, 5, acc); return;
#endif
        case 4: panel_block(x, k, wp, 4, acc); return;
        case 3: panel_block(x, k, wp, 3, acc); return;
        case 2: panel_block(x, k, wp, 2, acc); return;
        default: panel_block(x, k, wp, 1, acc); return;
    }
}
#endif

static void panel_rows(const float *x, long k, const uint16_t *wpanel, int rows, float *acc, int simd) {
#if PD_X86
    if (simd) {
        panel_rows_avx2(x, k, wpanel, rows, acc);
        return;
    }
#else
    (void)simd;
#endif
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < PANEL; j++) acc[r * PANEL + j] = 0.0f;
    for (long i = 0; i < k; i++) {
        const uint16_t *wi = wpanel + i * PANEL;
        for (int r = 0; r < rows; r++) {
            float xv = x[r * k + i];
            float *a = acc + r * PANEL;
            for (int j = 0; j < PANEL / 2; j++) {
                a[j] += xv * pd_bf2f(wi[2 * j]);
                a[j + PANEL / 2] += xv * pd_bf2f(wi[2 * j + 1]);
            }
        }
    }
}

int pd_gemm_bf16w(const uint16_t *x, long x_stride, long m, long k, const uint16_t *packed, long n,
                  const float *bias, uint16_t *out, long out_stride) {
    float *xf = malloc((size_t)(m * k > 0 ? m * k : 1) * sizeof(float));
    if (xf == NULL) return -1;
    for (long r = 0; r < m; r++)
        for (long i = 0; i < k; i++) xf[r * k + i] = pd_bf2f(x[r * x_stride + i]);
    long panels = (n + PANEL - 1) / PANEL;
    int simd = pd_gemm_simd();
    float acc[ROW_BLOCK * PANEL];
    for (long r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        long r_end = r0 + ROW_CHUNK < m ? r0 + ROW_CHUNK : m;
        for (long p = 0; p < panels; p++) {
            const uint16_t *wpanel = packed + p * k * PANEL;
            long c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
            for (long r = r0; r < r_end; r += ROW_BLOCK) {
                int rows = (int)(r_end - r < ROW_BLOCK ? r_end - r : ROW_BLOCK);
                panel_rows(xf + r * k, k, wpanel, rows, acc, simd);
                for (int rr = 0; rr < rows; rr++) {
                    uint16_t *o = out + (r + rr) * out_stride + c0;
                    const float *a = acc + rr * PANEL;
                    if (bias != NULL)
                        for (long j = 0; j < cols; j++) o[j] = pd_f2bf(a[j] + bias[c0 + j]);
                    else
                        for (long j = 0; j < cols; j++) o[j] = pd_f2bf(a[j]);
                }
            }
        }
    }
    free(xf);
    return 0;
}
