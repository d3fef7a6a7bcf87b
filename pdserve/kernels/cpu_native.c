/* pdserve's native CPU kernels for small bf16 steps: a CPython extension module (cpu_native_build.py
 * builds it with the host's C compiler; cpu_native.py loads it). Its functions take buffer addresses
 * (tensor.data_ptr()) and sizes as Python ints: one call costs ~0.2 us, against ~2 us through
 * ctypes, which mattered as much as the kernels.
 *
 * On the CPU a decode step of a small model is bound by the number of torch ops, not by
 * arithmetic: an RMS norm of one 128-wide row is ~7 ops and ~12-16 us, the same row's rotary and
 * KV store ~60 us a layer, a decode attention over ~150 keys ~75 us. Each function here does one
 * of those fused, in one call, with the torch twins' rounding points:
 *   - every bf16 value is widened to fp32 exactly, arithmetic is fp32, results are rounded to
 *     bf16 once where the twin rounds (round to nearest even, as c10::BFloat16);
 *   - built with -ffp-contract=off, so a*b - c*d is two products and a subtraction, as torch's
 *     separate ops compute it (no fused multiply-add).
 * Elementwise functions (rotary, the KV store, the residual add) give the twins' bits. The
 * reductions (the norm's mean of squares, attention's dot products and softmax) sum in another
 * order, silu and attention use the C library's expf here and a polynomial exp and FMA in their
 * AVX2 loops (cpu_activation.c, cpu_attention.c; taken where cpuid finds AVX2 + FMA): those can
 * differ from the twin by one bf16 step.
 *
 * Layouts are the engine's: rows with a stride (elements), a layer's KV cache view
 * [num_blocks, 2, block_size, num_kv_heads, head_dim] whose inner four dims are contiguous and
 * whose block stride is given, int64 positions and slots, int32 block tables and lengths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_activation.h"
#include "cpu_attention.h"
#include "cpu_gemm.h"

typedef uint16_t bf16;

#define LANES 16
#define MAX_HEAD_DIM 512
#define MAX_HEADS_PER_KV 64

static inline float bf2f(bf16 v) { return pd_bf2f(v); }

static inline bf16 f2bf(float f) { return pd_f2bf(f); }

/* sum of squares of n bf16 values, LANES partial sums (vectorisable without reassociation) */
static float sum_sq(const bf16 *x, long n) {
    float acc[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = bf2f(x[i + l]);
            acc[l] += v * v;
        }
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) {
        float v = bf2f(x[i]);
        s += v * v;
    }
    return s;
}

static void norm_row(const bf16 *x, const bf16 *w, float eps, bf16 *out, long h) {
    float inv = 1.0f / sqrtf(sum_sq(x, h) / (float)h + eps);
    for (long i = 0; i < h; i++) out[i] = f2bf((bf2f(x[i]) * inv) * bf2f(w[i]));
}

/* out[r] = x[r] / rms(x[r]) * w; out contiguous [rows, h] */
static void pd_rms_norm_bf16(const bf16 *x, long x_stride, const bf16 *w, float eps, bf16 *out, long rows,
                      long h) {
    for (long r = 0; r < rows; r++) norm_row(x + r * x_stride, w, eps, out + r * h, h);
}

/* new_res[r] = bf16(x[r] + res[r]); out[r] = rms_norm(new_res[r]); both contiguous [rows, h] */
static void pd_add_rms_norm_bf16(const bf16 *x, long x_stride, const bf16 *res, long res_stride,
                          const bf16 *w, float eps, bf16 *out, bf16 *new_res, long rows, long h) {
    for (long r = 0; r < rows; r++) {
        const bf16 *xr = x + r * x_stride, *rr = res + r * res_stride;
        bf16 *nr = new_res + r * h;
        for (long i = 0; i < h; i++) nr[i] = f2bf(bf2f(xr[i]) + bf2f(rr[i]));
        norm_row(nr, w, eps, out + r * h, h);
    }
}

/* out[r, i] = bf16(bf16(silu(gate)) * up), gate = gu[r, i], up = gu[r, inter + i]; out [rows, inter] */
static int silu_simd = 0; /* set at import: cpu_activation.c's AVX2 loop runs on this CPU */

static void pd_silu_mul_bf16(const bf16 *gu, long gu_stride, bf16 *out, long rows, long inter) {
    if (silu_simd) {
        pd_silu_mul_bf16_avx2(gu, gu_stride, out, rows, inter);
        return;
    }
    for (long r = 0; r < rows; r++) {
        const bf16 *g = gu + r * gu_stride, *u = g + inter;
        bf16 *o = out + r * inter;
        for (long i = 0; i < inter; i++) {
            float x = bf2f(g[i]);
            float s = bf2f(f2bf(x / (1.0f + expf(-x))));
            o[i] = f2bf(s * bf2f(u[i]));
        }
    }
}

/* NeoX rotation of one head: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) */
static inline void rotate_head(const bf16 *x, const float *c, const float *s, bf16 *out, long half) {
    for (long i = 0; i < half; i++) {
        float x1 = bf2f(x[i]), x2 = bf2f(x[i + half]);
        out[i] = f2bf(x1 * c[i] - x2 * s[i]);
        out[i + half] = f2bf(x2 * c[i] + x1 * s[i]);
    }
}

/* Token t's row of the fused projection: nh q heads, nkv k heads, nkv v heads of d each.
 * q_out[t] := rotated q ([n, nh, d] contiguous); the rotated k and the v go to the cache slot
 * slots[t] (block slots[t] / block_size, offset slots[t] % block_size), skipped when < 0.
 * cos_sin: [P, d] fp32 rows, cos in the first half, sin in the second. */
static void pd_rotary_store_bf16(const bf16 *qkv, long row_stride, long nh, long nkv, long d,
                          const int64_t *positions, const float *cos_sin, bf16 *cache,
                          long block_stride, long block_size, const int64_t *slots, long n,
                          bf16 *q_out) {
    long half = d / 2;
    for (long t = 0; t < n; t++) {
        const bf16 *row = qkv + t * row_stride;
        const float *c = cos_sin + positions[t] * d, *s = c + half;
        for (long h = 0; h < nh; h++) rotate_head(row + h * d, c, s, q_out + (t * nh + h) * d, half);
        int64_t slot = slots[t];
        if (slot < 0) continue;
        bf16 *k_dst = cache + (slot / block_size) * block_stride + (slot % block_size) * nkv * d;
        bf16 *v_dst = k_dst + block_size * nkv * d;
        for (long h = 0; h < nkv; h++) {
            rotate_head(row + (nh + h) * d, c, s, k_dst + h * d, half);
            memcpy(v_dst + h * d, row + (nh + nkv + h) * d, (size_t)d * sizeof(bf16));
        }
    }
}

static inline float dot_f_f(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[r, j] = bf16(sum_i x[r, i] w_t[i, j] + bias[j]): a few bf16 rows through a small layer whose
 * weight is kept in fp32 and transposed (models/linear.py's fp32 route: x widened, an fp32 GEMM,
 * one rounding). Accumulates whole output rows, i in order: no horizontal sums.
 * w_t: [n_in, n_out] contiguous fp32, bias fp32 or NULL, out: [rows, n_out] contiguous.
 * Returns -1 when the scratch could not be allocated (nothing written). */
static int pd_linear_bf16_f32(const bf16 *x, long x_stride, const float *w_t, const float *bias, bf16 *out,
                              long rows, long n_in, long n_out) {
    float *acc = malloc((size_t)(n_out > 0 ? n_out : 1) * sizeof(float));
    if (acc == NULL) return -1;
    for (long r = 0; r < rows; r++) {
        const bf16 *xr = x + r * x_stride;
        for (long j = 0; j < n_out; j++) acc[j] = 0.0f;
        for (long i = 0; i < n_in; i++) {
            float xi = bf2f(xr[i]);
            const float *wi = w_t + i * n_out;
            for (long j = 0; j < n_out; j++) acc[j] += xi * wi[j];
        }
        bf16 *o = out + r * n_out;
        if (bias != NULL)
            for (long j = 0; j < n_out; j++) o[j] = f2bf(acc[j] + bias[j]);
        else
            for (long j = 0; j < n_out; j++) o[j] = f2bf(acc[j]);
    }
    free(acc);
    return 0;
}

/* Grammar masks: every token of logits row rows[r] (r when rows is NULL) whose bit in bitmask
 * row r is clear, and every column past 32 * words, := -inf (neg_bits, the logits' dtype's -inf
 * pattern, in its low 16 or 32 bits); elem: 2 or 4 bytes. Bit j of word w is token 32 w + j
 * (xgrammar's layout). */
static void pd_apply_bitmask(void *logits, long row_stride, int elem, uint32_t neg_bits, const int64_t *rows,
                             long k, const int32_t *bitmask, long words, long vocab) {
    long n = 32 * words < vocab ? 32 * words : vocab;
    for (long r = 0; r < k; r++) {
        long row = rows != NULL ? (long)rows[r] : r;
        const uint32_t *m = (const uint32_t *)bitmask + r * words;
        if (elem == 4) {
            uint32_t *p = (uint32_t *)logits + row * row_stride;
            for (long w = 0; w * 32 < n; w++) {
                uint32_t bits = m[w];
                if (bits == 0xffffffffu) continue;
                long end = n - w * 32 < 32 ? n - w * 32 : 32;
                uint32_t *q = p + w * 32;
                for (long j = 0; j < end; j++) q[j] = (bits >> j) & 1u ? q[j] : neg_bits;
            }
            for (long t = n; t < vocab; t++) p[t] = neg_bits;
        } else {
            uint16_t *p = (uint16_t *)logits + row * row_stride, neg = (uint16_t)neg_bits;
            for (long w = 0; w * 32 < n; w++) {
                uint32_t bits = m[w];
                if (bits == 0xffffffffu) continue;
                long end = n - w * 32 < 32 ? n - w * 32 : 32;
                uint16_t *q = p + w * 32;
                for (long j = 0; j < end; j++) q[j] = (bits >> j) & 1u ? q[j] : neg;
            }
            for (long t = n; t < vocab; t++) p[t] = neg;
        }
    }
}

/* LANES partial sums of a . b, folded as a tree (vectorisable: no reassociation is needed) */
static inline float dot_tree(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The portable loop of causal attention over the paged cache, this step's K/V already stored
 * (cpu_attention.c has the AVX2 kernel, same contract; pd_attention_bf16 picks). Request b's query tokens
 * are rows query_start[b] .. query_start[b + 1] - 1 of q and out ([T, nh, d] contiguous); they
 * are the last of its seq_lens[b] positions, and token i of n sees positions 0 .. seq_len - n + i.
 * K and V of query head h are those of KV head h / (nh / nkv); the query heads that share a KV
 * head go together, each cached key and value row widened to fp32 once for all of them. A decode
 * step is the case of one query per request. Returns 0, or -1 when the scratch could not be
 * allocated (nothing written). */
static int pd_attention_bf16_scalar(const bf16 *q, const bf16 *cache, long block_stride, long block_size, long nkv,
                             long d, const int32_t *block_tables, long bt_stride, const int32_t *query_start,
                             const int32_t *seq_lens, long batch, long nh, float scale, bf16 *out) {
    long max_len = 0;
    for (long b = 0; b < batch; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    if (max_len < 1) max_len = 1;
    long group = nh / nkv, v_off = block_size * nkv * d;
    /* scores [group, max_len], then the group's queries and accumulators [group, d] each */
    float *p = malloc((size_t)(group * max_len + 2 * group * d) * sizeof(float));
    if (p == NULL) return -1;
    float *qf = p + group * max_len, *acc = qf + group * d;
    float row[MAX_HEAD_DIM], m[MAX_HEADS_PER_KV], total[MAX_HEADS_PER_KV];
    for (long b = 0; b < batch; b++) {
        long first = query_start[b], n_q = query_start[b + 1] - first, seq_len = seq_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        for (long t = 0; t < n_q; t++) {
            long tok = first + t, len = seq_len - n_q + t + 1; /* causal: keys 0 .. len - 1 */
            for (long kvh = 0; kvh < nkv; kvh++) {
                long h0 = kvh * group;
                for (long g = 0; g < group; g++) {
                    const bf16 *qh = q + (tok * nh + h0 + g) * d;
                    for (long i = 0; i < d; i++) qf[g * d + i] = bf2f(qh[i]);
                    m[g] = -INFINITY;
                    total[g] = 0.0f;
                }
                for (long s0 = 0; s0 < len; s0 += block_size) { /* block by block: no division per key */
                    const bf16 *k = cache + (long)table[s0 / block_size] * block_stride + kvh * d;
                    long nk = len - s0 < block_size ? len - s0 : block_size;
                    for (long o = 0; o < nk; o++, k += nkv * d) {
                        for (long i = 0; i < d; i++) row[i] = bf2f(k[i]);
                        for (long g = 0; g < group; g++) {
                            float score = dot_tree(qf + g * d, row, d) * scale;
                            p[g * max_len + s0 + o] = score;
                            if (score > m[g]) m[g] = score;
                        }
                    }
                }
                for (long g = 0; g < group; g++) {
                    float *pg = p + g * max_len;
                    for (long s = 0; s < len; s++) {
                        pg[s] = expf(pg[s] - m[g]);
                        total[g] += pg[s];
                    }
                }
                for (long i = 0; i < group * d; i++) acc[i] = 0.0f;
                for (long s0 = 0; s0 < len; s0 += block_size) {
                    const bf16 *v = cache + (long)table[s0 / block_size] * block_stride + v_off + kvh * d;
                    long nk = len - s0 < block_size ? len - s0 : block_size;
                    for (long o = 0; o < nk; o++, v += nkv * d) {
                        for (long i = 0; i < d; i++) row[i] = bf2f(v[i]);
                        for (long g = 0; g < group; g++) {
                            float w = p[g * max_len + s0 + o];
                            float *ag = acc + g * d;
                            for (long i = 0; i < d; i++) ag[i] += w * row[i];
                        }
                    }
                }
                for (long g = 0; g < group; g++) {
                    bf16 *oh = out + (tok * nh + h0 + g) * d;
                    if (len <= 0 || !(total[g] > 0.0f)) { /* no keys (or a NaN row): NaN, as SDPA gives */
                        for (long i = 0; i < d; i++) oh[i] = (bf16)0x7fc0;
                        continue;
                    }
                    for (long i = 0; i < d; i++) oh[i] = f2bf(acc[g * d + i] / total[g]);
                }
            }
        }
    }
    free(p);
    return 0;
}

/* Whether attention takes cpu_attention.c's AVX2 path where it applies (head_dim a multiple of 16):
 * set at import to whether this CPU has AVX2 + FMA; attention_simd(0) turns it off (tests and the
 * paired benchmarks compare the two paths in one process). */
static int attention_simd = 0;

static int pd_attention_bf16(const bf16 *q, const bf16 *cache, long block_stride, long block_size, long nkv,
                             long d, const int32_t *block_tables, long bt_stride, const int32_t *query_start,
                             const int32_t *seq_lens, long batch, long nh, float scale, bf16 *out) {
    if (attention_simd && d % 16 == 0 && d <= MAX_HEAD_DIM && nh / nkv <= MAX_HEADS_PER_KV)
        return pd_attention_bf16_avx2(q, cache, block_stride, block_size, nkv, d, block_tables, bt_stride,
                                      query_start, seq_lens, batch, nh, scale, out);
    return pd_attention_bf16_scalar(q, cache, block_stride, block_size, nkv, d, block_tables, bt_stride,
                                    query_start, seq_lens, batch, nh, scale, out);
}

/* ------------------------------------------------------------------------- the Python module */

#define ABI_VERSION 8

/* args[i] as a C long / pointer / float; *bad set on a wrong type (Python's error is set) */
static long arg_l(PyObject *const *args, Py_ssize_t i, int *bad) {
    long v = PyLong_AsLong(args[i]);
    if (v == -1 && PyErr_Occurred()) *bad = 1;
    return v;
}
/* an address; 0 is allowed (an empty tensor's), the sizes that come with it are then 0 */
static void *arg_p(PyObject *const *args, Py_ssize_t i, int *bad) {
    void *v = PyLong_AsVoidPtr(args[i]);
    if (v == NULL && PyErr_Occurred()) *bad = 1;
    return v;
}
static float arg_f(PyObject *const *args, Py_ssize_t i, int *bad) {
    double v = PyFloat_AsDouble(args[i]);
    if (v == -1.0 && PyErr_Occurred()) *bad = 1;
    return (float)v;
}
static int nargs_ok(const char *name, Py_ssize_t got, Py_ssize_t want) {
    if (got == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, got);
    return 0;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("rms_norm", n, 7)) return NULL;
    int bad = 0;
    const bf16 *x = arg_p(args, 0, &bad);
    long xs = arg_l(args, 1, &bad);
    const bf16 *w = arg_p(args, 2, &bad);
    float eps = arg_f(args, 3, &bad);
    bf16 *out = arg_p(args, 4, &bad);
    long rows = arg_l(args, 5, &bad), h = arg_l(args, 6, &bad);
    if (bad) return NULL;
    pd_rms_norm_bf16(x, xs, w, eps, out, rows, h);
    Py_RETURN_NONE;
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("add_rms_norm", n, 10)) return NULL;
    int bad = 0;
    const bf16 *x = arg_p(args, 0, &bad);
    long xs = arg_l(args, 1, &bad);
    const bf16 *res = arg_p(args, 2, &bad);
    long rs = arg_l(args, 3, &bad);
    const bf16 *w = arg_p(args, 4, &bad);
    float eps = arg_f(args, 5, &bad);
    bf16 *out = arg_p(args, 6, &bad), *new_res = arg_p(args, 7, &bad);
    long rows = arg_l(args, 8, &bad), h = arg_l(args, 9, &bad);
    if (bad) return NULL;
    pd_add_rms_norm_bf16(x, xs, res, rs, w, eps, out, new_res, rows, h);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("silu_mul", n, 5)) return NULL;
    int bad = 0;
    const bf16 *gu = arg_p(args, 0, &bad);
    long gs = arg_l(args, 1, &bad);
    bf16 *out = arg_p(args, 2, &bad);
    long rows = arg_l(args, 3, &bad), inter = arg_l(args, 4, &bad);
    if (bad) return NULL;
    pd_silu_mul_bf16(gu, gs, out, rows, inter);
    Py_RETURN_NONE;
}

static PyObject *py_rotary_store(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("rotary_store", n, 13)) return NULL;
    int bad = 0;
    const bf16 *qkv = arg_p(args, 0, &bad);
    long row = arg_l(args, 1, &bad), nh = arg_l(args, 2, &bad), nkv = arg_l(args, 3, &bad);
    long d = arg_l(args, 4, &bad);
    const int64_t *pos = arg_p(args, 5, &bad);
    const float *cs = arg_p(args, 6, &bad);
    bf16 *cache = arg_p(args, 7, &bad);
    long block_stride = arg_l(args, 8, &bad), block_size = arg_l(args, 9, &bad);
    const int64_t *slots = arg_p(args, 10, &bad);
    long tokens = arg_l(args, 11, &bad);
    bf16 *q_out = arg_p(args, 12, &bad);
    if (bad) return NULL;
    pd_rotary_store_bf16(qkv, row, nh, nkv, d, pos, cs, cache, block_stride, block_size, slots, tokens, q_out);
    Py_RETURN_NONE;
}

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("attention", n, 14)) return NULL;
    int bad = 0;
    const bf16 *q = arg_p(args, 0, &bad);
    const bf16 *cache = arg_p(args, 1, &bad);
    long block_stride = arg_l(args, 2, &bad), block_size = arg_l(args, 3, &bad);
    long nkv = arg_l(args, 4, &bad), d = arg_l(args, 5, &bad);
    const int32_t *tables = arg_p(args, 6, &bad);
    long bt_stride = arg_l(args, 7, &bad);
    const int32_t *starts = arg_p(args, 8, &bad);
    const int32_t *lens = arg_p(args, 9, &bad);
    long batch = arg_l(args, 10, &bad), nh = arg_l(args, 11, &bad);
    float scale = arg_f(args, 12, &bad);
    bf16 *out = arg_p(args, 13, &bad);
    if (bad) return NULL;
    if (pd_attention_bf16(q, cache, block_stride, block_size, nkv, d, tables, bt_stride, starts, lens, batch, nh,
                          scale, out) != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* attention_simd(flag): flag 1 turns the AVX2 attention on (where the CPU has it), 0 off, -1 asks;
 * returns whether it is on */
static PyObject *py_attention_simd(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("attention_simd", n, 1)) return NULL;
    int bad = 0;
    long flag = arg_l(args, 0, &bad);
    if (bad) return NULL;
    if (flag >= 0) attention_simd = flag > 0 && pd_attention_simd_supported();
    return PyBool_FromLong(attention_simd);
}

static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("linear", n, 8)) return NULL;
    int bad = 0;
    const bf16 *x = arg_p(args, 0, &bad);
    long xs = arg_l(args, 1, &bad);
    const float *w = arg_p(args, 2, &bad);
    const float *bias = args[3] == Py_None ? NULL : arg_p(args, 3, &bad);
    bf16 *out = arg_p(args, 4, &bad);
    long rows = arg_l(args, 5, &bad), n_in = arg_l(args, 6, &bad), n_out = arg_l(args, 7, &bad);
    if (bad) return NULL;
    if (pd_linear_bf16_f32(x, xs, w, bias, out, rows, n_in, n_out) != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_gemm_pack(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("gemm_pack", n, 4)) return NULL;
    int bad = 0;
    const bf16 *w = arg_p(args, 0, &bad);
    long n_out = arg_l(args, 1, &bad), n_in = arg_l(args, 2, &bad);
    bf16 *packed = arg_p(args, 3, &bad);
    if (bad) return NULL;
    pd_gemm_pack(w, n_out, n_in, packed);
    Py_RETURN_NONE;
}

static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("gemm", n, 9)) return NULL;
    int bad = 0;
    const bf16 *x = arg_p(args, 0, &bad);
    long xs = arg_l(args, 1, &bad), rows = arg_l(args, 2, &bad), n_in = arg_l(args, 3, &bad);
    const bf16 *packed = arg_p(args, 4, &bad);
    long n_out = arg_l(args, 5, &bad);
    const float *bias = args[6] == Py_None ? NULL : arg_p(args, 6, &bad);
    bf16 *out = arg_p(args, 7, &bad);
    long os = arg_l(args, 8, &bad);
    if (bad) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pd_gemm_bf16w(x, xs, rows, n_in, packed, n_out, bias, out, os);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_gemm_simd(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("gemm_simd", n, 0)) return NULL;
    return PyLong_FromLong(pd_gemm_simd());
}

static PyObject *py_apply_bitmask(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    if (!nargs_ok("apply_bitmask", n, 9)) return NULL;
    int bad = 0;
    void *logits = arg_p(args, 0, &bad);
    long row_stride = arg_l(args, 1, &bad), elem = arg_l(args, 2, &bad);
    uint32_t neg = (uint32_t)PyLong_AsUnsignedLongMask(args[3]);
    if (neg == (uint32_t)-1 && PyErr_Occurred()) bad = 1;
    const int64_t *rows = args[4] == Py_None ? NULL : arg_p(args, 4, &bad);
    long k = arg_l(args, 5, &bad);
    const int32_t *bitmask = arg_p(args, 6, &bad);
    long words = arg_l(args, 7, &bad), vocab = arg_l(args, 8, &bad);
    if (bad) return NULL;
    if (elem != 2 && elem != 4) {
        PyErr_Format(PyExc_ValueError, "apply_bitmask: element size %ld is not 2 or 4", elem);
        return NULL;
    }
    pd_apply_bitmask(logits, row_stride, (int)elem, neg, rows, k, bitmask, words, vocab);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"apply_bitmask", (PyCFunction)(void (*)(void))py_apply_bitmask, METH_FASTCALL, NULL},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, NULL},
    {"gemm_pack", (PyCFunction)(void (*)(void))py_gemm_pack, METH_FASTCALL, NULL},
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL, NULL},
    {"gemm_simd", (PyCFunction)(void (*)(void))py_gemm_simd, METH_FASTCALL, NULL},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, NULL},
    {"add_rms_norm", (PyCFunction)(void (*)(void))py_add_rms_norm, METH_FASTCALL, NULL},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, NULL},
    {"rotary_store", (PyCFunction)(void (*)(void))py_rotary_store, METH_FASTCALL, NULL},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL, NULL},
    {"attention_simd", (PyCFunction)(void (*)(void))py_attention_simd, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdserve_cpu_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_pdserve_cpu_native(void) {
    attention_simd = pd_attention_simd_supported();
    silu_simd = pd_silu_simd_supported();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0 ||
                      PyModule_AddIntConstant(m, "SILU_SIMD", silu_simd) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
