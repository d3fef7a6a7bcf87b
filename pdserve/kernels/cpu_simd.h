/* What cpu_attention.c and cpu_activation.c share: the AVX2 + FMA helpers (functions with their own
 * target attribute, so every x86-64 build has them; callers run them only where
 * pd_avx2_fma_supported()), bf16 <-> fp32 on 16 elements, and a vector exp. */
#ifndef PDSERVE_CPU_SIMD_H
#define PDSERVE_CPU_SIMD_H

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PD_X86 1
#else
#define PD_X86 0
#endif

/* 1 when this CPU has AVX2 and FMA (x86-64: cpuid, which also checks that the OS saves the
 * registers; 1 at once in a build for such a CPU), else 0 */
static inline int pd_avx2_fma_supported(void) {
#if PD_X86
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#else
    return 0;
#endif
}

#if PD_X86
#include <immintrin.h>

typedef uint16_t bf16;

#define AVX2_FN __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

/* A 256-bit load of 16 bf16 holds elements 2j (low half) and 2j + 1 (high half) in lane j: a shift
 * widens the even ones, a mask the odd ones, both exactly. */
AVX2_INLINE __m256 widen_even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }

AVX2_INLINE __m256 widen_odd(__m256i x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

/* exp(x): 2^n * poly(r), r = x - n ln 2 in two parts (Cephes' expf), within 2 ulp of expf for
 * x <= 88; e^88 up to 88.72, +inf past it (as expf), 0x1p-126 below -87.34; NaN stays NaN */
AVX2_INLINE __m256 exp8(__m256 x) {
    __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x); /* min / max give x back when it is NaN */
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), over);
}

/* fp32 -> bf16 rounded to nearest even in each lane's high half; NaN -> 0x7fc0 */
AVX2_INLINE __m256i round_bf16(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
}

/* 16 bf16 from the even (elements 0, 2, ..) and odd (1, 3, ..) fp32 vectors, in order */
AVX2_INLINE void store_bf16(bf16 *dst, __m256 even, __m256 odd) {
    __m256i e = _mm256_srli_epi32(round_bf16(even), 16);
    __m256i o = _mm256_and_si256(round_bf16(odd), _mm256_set1_epi32((int)0xffff0000u));
    _mm256_storeu_si256((__m256i *)dst, _mm256_or_si256(e, o));
}

#endif /* PD_X86 */

#endif
