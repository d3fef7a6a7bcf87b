/* Paged causal attention on AVX2 + FMA (cpu_native.c's pd_attention_bf16, same arguments and
 * result; that file keeps the portable scalar loop, which took ~1.2 ms a layer of a SmolLM2-135M
 * decode step at 16 requests on a 2-core AVX2 host: docs/benchmarks.md, "CPU engine on
 * SmolLM2-135M").
 *
 * Per query token, all its heads together, over the context's blocks in order (a block's K rows
 * then its V rows are contiguous; the next blocks are prefetched, K towards L1, V towards L2):
 *   1. scores: keys 8 at a time, read in place; a 16-element slice of a bf16 row is one 256-bit
 *      load, widened to fp32 exactly with a shift (even elements) and a mask (odd ones); the
 *      queries are kept in that even / odd order, so the dot products need no shuffle; the 8
 *      keys' sums fold into one vector of 8 scores (hadd + one permute); a key row (every KV head)
 *      serves all the query heads while it is in L1;
 *   2. softmax: the max over the scores, then exp(s - max) 8 at a time (Cephes' expf polynomial,
 *      within 2 ulp of expf) and its sum;
 *   3. p . V block by block: for up to 4 query heads of one KV head, 16 columns of accumulators
 *      stay in registers while the block's V slices are loaded and widened once for all of them.
 * fp32 throughout (FMA), one division by the sum and one bf16 rounding at the end (nearest even,
 * NaN canonical, as c10::BFloat16). Sums go in another order than the scalar loop and the torch
 * twin: results can differ from them by one bf16 step.
 *
 * Built into every x86-64 module: the functions carry target("avx2,fma") and run only after
 * pd_attention_simd_supported() (cpuid, at run time), so a portable build is safe on an older CPU.
 */
#include "cpu_attention.h"

#include <math.h>
#include <stdlib.h>

#include "cpu_simd.h"

int pd_attention_simd_supported(void) { return pd_avx2_fma_supported(); }

#if PD_X86
#define KEYS 8 /* keys per score vector */

AVX2_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

AVX2_INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* [sum(a[0]), ..., sum(a[7])] */
AVX2_INLINE __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* the cache lines of [a, a + bytes) towards L1 (K rows about to be read) or L2 (V rows read later) */
AVX2_INLINE void prefetch_l1(const void *a, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch((const char *)a + i, _MM_HINT_T0);
}

AVX2_INLINE void prefetch_l2(const void *a, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch((const char *)a + i, _MM_HINT_T1);
}

/* blocks prefetched ahead: 1, 2 and 4 measured alike (16-64 requests x 150-500 keys) */
#define PREFETCH_BLOCKS 2
/* a block's keys (v_off elements) towards L1, its values (the next v_off) towards L2 */
AVX2_INLINE void prefetch_block(const bf16 *block, long v_off) {
    prefetch_l1(block, v_off * 2);
    prefetch_l2(block + v_off, v_off * 2);
}

/* the 8 scores q . k[j] (q in even / odd order, d % 16 == 0) */
AVX2_INLINE __m256 dot8(const float *qf, const bf16 *const *kp, long d) {
    __m256 acc[KEYS];
    for (int j = 0; j < KEYS; j++) acc[j] = _mm256_setzero_ps();
    for (long i = 0; i < d; i += 16) {
        __m256 qe = _mm256_loadu_ps(qf + i), qo = _mm256_loadu_ps(qf + i + 8);
        for (int j = 0; j < KEYS; j++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(kp[j] + i));
            acc[j] = _mm256_fmadd_ps(qe, widen_even(x), acc[j]);
            acc[j] = _mm256_fmadd_ps(qo, widen_odd(x), acc[j]);
        }
    }
    return hsum8(acc);
}

/* acc[h] += sum_o p[h][o] V[o] over the nk keys of one block (rows v + o * row at this KV head) for
 * hs <= 4 heads (p + h * p_stride, acc + h * d), 16 columns at a time: the tile's 8 accumulators
 * stay in registers over the block (3 heads x 32 columns was no faster: 12 accumulators leave too
 * few registers, and GCC spills). hs: a constant after inlining. */
AVX2_INLINE void pv_tile(int hs, const float *p, long p_stride, const bf16 *v, long row, long nk, long d, float *acc) {
    for (long c = 0; c < d; c += 16) {
        __m256 a[4][2];
        for (int h = 0; h < hs; h++)
            for (int k = 0; k < 2; k++) a[h][k] = _mm256_loadu_ps(acc + h * d + c + 8 * k);
        const bf16 *vr = v + c;
        for (long o = 0; o < nk; o++, vr += row) {
            __m256i x = _mm256_loadu_si256((const __m256i *)vr);
            __m256 ve = widen_even(x), vo = widen_odd(x);
            for (int h = 0; h < hs; h++) {
                __m256 w = _mm256_broadcast_ss(p + h * p_stride + o);
                a[h][0] = _mm256_fmadd_ps(w, ve, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(w, vo, a[h][1]);
            }
        }
        for (int h = 0; h < hs; h++)
            for (int k = 0; k < 2; k++) _mm256_storeu_ps(acc + h * d + c + 8 * k, a[h][k]);
    }
}

/* pv_tile over the group heads of one KV head, 4 at a time */
AVX2_INLINE void pv_block(long group, const float *p, long p_stride, const bf16 *v, long row, long nk, long d,
                          float *acc) {
    for (long g = 0; g < group; g += 4) {
        const float *pg = p + g * p_stride;
        float *ag = acc + g * d;
        switch (group - g) {
        case 1: pv_tile(1, pg, p_stride, v, row, nk, d, ag); break;
        case 2: pv_tile(2, pg, p_stride, v, row, nk, d, ag); break;
        case 3: pv_tile(3, pg, p_stride, v, row, nk, d, ag); break;
        default: pv_tile(4, pg, p_stride, v, row, nk, d, ag);
        }
    }
}

AVX2_FN int pd_attention_bf16_avx2(const bf16 *q, const bf16 *cache, long block_stride, long block_size,
                                   long nkv, long d, const int32_t *block_tables, long bt_stride,
                                   const int32_t *query_start, const int32_t *seq_lens, long batch, long nh,
                                   float scale, bf16 *out) {
    long max_len = 0;
    for (long b = 0; b < batch; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    long group = nh / nkv, row = nkv * d, v_off = block_size * row;
    long p_stride = (max_len + KEYS - 1) / KEYS * KEYS + KEYS; /* whole vectors of scores */
    /* scores [nh, p_stride]; queries [nh, d] (even / odd order); accumulators [nh, d]; sums [nh];
     * the scores' running maxima [nh, KEYS] */
    float *p = malloc((size_t)(nh * p_stride + 2 * nh * d + nh + nh * KEYS) * sizeof(float));
    if (p == NULL) return -1;
    float *qf = p + nh * p_stride, *acc = qf + nh * d, *total = acc + nh * d, *m = total + nh;
    const __m256 scale8 = _mm256_set1_ps(scale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (long b = 0; b < batch; b++) {
        long first = query_start[b], n_q = query_start[b + 1] - first, seq_len = seq_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        for (long t = 0; t < n_q; t++) {
            long tok = first + t, len = seq_len - n_q + t + 1; /* causal: keys 0 .. len - 1 */
            bf16 *ot = out + tok * nh * d;
            if (len <= 0) { /* no keys: NaN, as SDPA gives */
                for (long i = 0; i < nh * d; i++) ot[i] = (bf16)0x7fc0;
                continue;
            }
            const bf16 *qt = q + tok * nh * d;
            for (long i = 0; i < nh * d; i += 16) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(qt + i));
                _mm256_storeu_ps(qf + i, widen_even(x));
                _mm256_storeu_ps(qf + i + 8, widen_odd(x));
            }
            /* 1. scores, 8 keys at a time (a short last chunk repeats its first key), all heads */
            for (long h = 0; h < nh; h++) _mm256_storeu_ps(m + h * KEYS, _mm256_set1_ps(-INFINITY));
            long bi = 0, off = 0, blocks = (len + block_size - 1) / block_size;
            for (long j = 0; j < PREFETCH_BLOCKS && j < blocks; j++)
                prefetch_block(cache + (long)table[j] * block_stride, v_off);
            for (long s0 = 0; s0 < len; s0 += KEYS) {
                if (off == 0 && bi + PREFETCH_BLOCKS < blocks)
                    prefetch_block(cache + (long)table[bi + PREFETCH_BLOCKS] * block_stride, v_off);
                const bf16 *kp[KEYS];
                long n = len - s0 < KEYS ? len - s0 : KEYS;
                for (long j = 0; j < n; j++) {
                    kp[j] = cache + (long)table[bi] * block_stride + off * row;
                    if (++off == block_size) off = 0, bi++;
                }
                for (long j = n; j < KEYS; j++) kp[j] = kp[0];
                for (long kvh = 0; kvh < nkv; kvh++) {
                    for (long g = 0, h = kvh * group; g < group; g++, h++) {
                        __m256 s = _mm256_mul_ps(dot8(qf + h * d, kp, d), scale8);
                        _mm256_storeu_ps(p + h * p_stride + s0, s);
                        _mm256_storeu_ps(m + h * KEYS, _mm256_max_ps(_mm256_loadu_ps(m + h * KEYS), s));
                    }
                    for (long j = 0; j < KEYS; j++) kp[j] += d;
                }
            }
            /* 2. p := exp(s - max), total := sum p (lanes past len: 0) */
            for (long h = 0; h < nh; h++) {
                float *ph = p + h * p_stride;
                __m256 mx = _mm256_set1_ps(hmax(_mm256_loadu_ps(m + h * KEYS))), sum = _mm256_setzero_ps();
                for (long s0 = 0; s0 < len; s0 += KEYS) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ph + s0), mx));
                    if (len - s0 < KEYS)
                        e = _mm256_and_ps(e, _mm256_castsi256_ps(
                                                 _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - s0)), lane)));
                    _mm256_storeu_ps(ph + s0, e);
                    sum = _mm256_add_ps(sum, e);
                }
                total[h] = hsum(sum);
            }
            /* 3. acc := p . V block by block, out := bf16(acc / total) */
            for (long i = 0; i < nh * d; i++) acc[i] = 0.0f;
            for (long s0 = 0, blk = 0; s0 < len; s0 += block_size, blk++) {
                const bf16 *v = cache + (long)table[blk] * block_stride + v_off;
                long nk = len - s0 < block_size ? len - s0 : block_size;
                for (long kvh = 0; kvh < nkv; kvh++)
                    pv_block(group, p + kvh * group * p_stride + s0, p_stride, v + kvh * d, row, nk, d,
                             acc + kvh * group * d);
            }
            for (long h = 0; h < nh; h++) {
                bf16 *oh = ot + h * d;
                if (!(total[h] > 0.0f)) { /* a NaN row: NaN, as the scalar loop gives */
                    for (long i = 0; i < d; i++) oh[i] = (bf16)0x7fc0;
                    continue;
                }
                __m256 tot = _mm256_set1_ps(total[h]);
                for (long i = 0; i < d; i += 16)
                    store_bf16(oh + i, _mm256_div_ps(_mm256_loadu_ps(acc + h * d + i), tot),
                               _mm256_div_ps(_mm256_loadu_ps(acc + h * d + i + 8), tot));
            }
        }
    }
    free(p);
    return 0;
}

#else

int pd_attention_bf16_avx2(const uint16_t *q, const uint16_t *cache, long block_stride, long block_size,
                           long nkv, long d, const int32_t *block_tables, long bt_stride,
                           const int32_t *query_start, const int32_t *seq_lens, long batch, long nh,
                           float scale, uint16_t *out) {
    (void)q, (void)cache, (void)block_stride, (void)block_size, (void)nkv, (void)d, (void)block_tables;
    (void)bt_stride, (void)query_start, (void)seq_lens, (void)batch, (void)nh, (void)scale, (void)out;
    abort(); /* never called: pd_attention_simd_supported() is 0 */
}

#endif
