/* silu(gate) * up on AVX2 + FMA (cpu_native.c's pd_silu_mul_bf16, which keeps the portable loop
 * with the C library's expf). 16 elements at a time: gate and up widened to fp32 exactly,
 * silu = x / (1 + exp(-x)) with cpu_simd.h's exp (within 2 ulp of expf up to e^88; x < -88.72 gives
 * -0 as the twin's tiny product rounds to, -inf gives NaN as the twin), rounded to bf16 as the twin
 * rounds it, times up, rounded again; the tail of a row (inter % 16) takes the scalar formula.
 * Results can differ from the twin by one bf16 step (the exp). 16 x 1536 outputs: 30 against
 * torch's 44 µs (one thread, 2-core AVX2 host). */
#include "cpu_activation.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemm.h"
#include "cpu_simd.h"

int pd_silu_simd_supported(void) { return pd_avx2_fma_supported(); }

#if PD_X86

/* bf16(silu(x)) widened back to fp32 */
AVX2_INLINE __m256 silu_bf16(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    return _mm256_castsi256_ps(_mm256_and_si256(round_bf16(s), _mm256_set1_epi32((int)0xffff0000u)));
}

AVX2_FN void pd_silu_mul_bf16_avx2(const bf16 *gu, long gu_stride, bf16 *out, long rows, long inter) {
    for (long r = 0; r < rows; r++) {
        const bf16 *g = gu + r * gu_stride, *u = g + inter;
        bf16 *o = out + r * inter;
        long i = 0;
        for (; i + 16 <= inter; i += 16) {
            __m256i gx = _mm256_loadu_si256((const __m256i *)(g + i));
            __m256i ux = _mm256_loadu_si256((const __m256i *)(u + i));
            store_bf16(o + i, _mm256_mul_ps(silu_bf16(widen_even(gx)), widen_even(ux)),
                       _mm256_mul_ps(silu_bf16(widen_odd(gx)), widen_odd(ux)));
        }
        for (; i < inter; i++) {
            float x = pd_bf2f(g[i]);
            float s = pd_bf2f(pd_f2bf(x / (1.0f + expf(-x))));
            o[i] = pd_f2bf(s * pd_bf2f(u[i]));
        }
    }
}

#else

void pd_silu_mul_bf16_avx2(const uint16_t *gu, long gu_stride, uint16_t *out, long rows, long inter) {
    (void)gu, (void)gu_stride, (void)out, (void)rows, (void)inter;
    abort(); /* never called: pd_silu_simd_supported() is 0 */
}

#endif
