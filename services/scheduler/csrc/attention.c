/* Attention kernels for CPU float32: decode over the dense decode cache, and prefill (extend) over a
 * request's gathered keys. Both are the same per-query routine, `head`.
 *
 * `head` takes one query token's G query heads (the group of one KV head), scores them against that
 * KV head's keys [0, len), softmaxes, and weights the values. K is stored transposed (K^T rows are
 * position-contiguous), so scores build up 64 positions at a time in registers with vector FMAs over d,
 * no horizontal sums; K and V are each read once per query, and only up to `len` (padding past it is
 * never touched). G and D are compile-time constants in the common shapes, so the accumulators stay in
 * registers. Plain C vectorized by the compiler (omp simd; -ffast-math lets expf vectorize through
 * glibc's libmvec). Work is split over `threads` OpenMP threads (torch's own count; torch's CPU build
 * uses the same libgomp, so this shares its thread pool).
 *
 * decode_attention_f32: one query per request row, len = lens[b].
 *   q [B, H, G, D]; kt [Bcap, H, D, Lcap] (rows 0..B-1 used); v [Bcap, H, Lcap, D]; out [B, H, G, D]
 * extend_attention_f32: request b's new tokens q_start[b] .. q_start[b+1]-1 follow prefix[b] cached
 *   ones; its i-th new token sees keys [0, prefix[b] + i] (causal after the prefix). Requests run one
 *   (b, KV head) pair per task, so a request's K/V stay in cache while all its queries read them.
 *   q [T, H, G, D] (T = q_start[B]); kt [B, H, D, Lcap]; v [B, H, Lcap, D]; out [T, H, G, D]
 * scratch: threads * G * Lcap floats. All int64 except `threads`; all arrays contiguous.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define BL 64
#define GMAX 16

static inline __attribute__((always_inline)) void head(const float *restrict qb, const float *restrict kb,
                                                        const float *restrict vb, float *restrict ob,
                                                        float *restrict s, int64_t len, int64_t Lcap,
                                                        float scale, const int64_t G, const int64_t D) {
    /* scores: s[g * Lcap + l] = scale * q[g] . K[l] */
    for (int64_t l0 = 0; l0 < len; l0 += BL) {
        float acc[GMAX][BL];
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < BL; i++) acc[g][i] = 0.0f;
        if (l0 + BL <= Lcap) { /* full-width loads stay inside the buffer (past len: ignored) */
            for (int64_t d = 0; d < D; d++) {
                const float *restrict kd = kb + d * Lcap + l0;
                for (int64_t g = 0; g < G; g++) {
                    const float qd = qb[g * D + d];
#pragma omp simd
                    for (int64_t i = 0; i < BL; i++) acc[g][i] += qd * kd[i];
                }
            }
        } else {
            const int64_t n = len - l0;
            for (int64_t d = 0; d < D; d++) {
                const float *restrict kd = kb + d * Lcap + l0;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < n; i++) acc[g][i] += qb[g * D + d] * kd[i];
            }
        }
        const int64_t n = len - l0 < BL ? len - l0 : BL;
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < n; i++) s[g * Lcap + l0 + i] = acc[g][i] * scale;
    }
    /* softmax over [0, len) per query head */
    for (int64_t g = 0; g < G; g++) {
        float *restrict sg = s + g * Lcap;
        float m = sg[0];
#pragma omp simd reduction(max : m)
        for (int64_t l = 1; l < len; l++) m = sg[l] > m ? sg[l] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < len; l++) {
            sg[l] = expf(sg[l] - m);
            sum += sg[l];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t l = 0; l < len; l++) sg[l] *= inv;
    }
    /* out[g] = sum_l p[g][l] V[l] */
    float acc[GMAX][128];
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
    for (int64_t l = 0; l < len; l++) {
        const float *restrict vl = vb + l * D;
        for (int64_t g = 0; g < G; g++) {
            const float p = s[g * Lcap + l];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * vl[d];
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) ob[g * D + d] = acc[g][d];
}

/* One (G, D) specialization per common shape, so `head` unrolls; BODY(GC, DC) is the parallel loop. */
#define DISPATCH(BODY)                                                                                 \
    if (D == 32) {                                                                                     \
        if (G == 1) { BODY(1, 32) } else if (G == 2) { BODY(2, 32) } else if (G == 4) { BODY(4, 32) }  \
        else { BODY(G, 32) }                                                                           \
    } else if (D == 64) {                                                                              \
        if (G == 1) { BODY(1, 64) } else if (G == 2) { BODY(2, 64) } else if (G == 3) { BODY(3, 64) }  \
        else if (G == 4) { BODY(4, 64) } else if (G == 7) { BODY(7, 64) } else if (G == 8) { BODY(8, 64) } \
        else { BODY(G, 64) }                                                                           \
    } else if (D == 128) {                                                                             \
        if (G == 1) { BODY(1, 128) } else if (G == 2) { BODY(2, 128) } else if (G == 3) { BODY(3, 128) } \
        else if (G == 4) { BODY(4, 128) } else if (G == 7) { BODY(7, 128) } else if (G == 8) { BODY(8, 128) } \
        else { BODY(G, 128) }                                                                          \
    } else { BODY(G, D) }

#define DECODE_ROWS(GC, DC)                                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                 \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                           \
        float *s = scratch + (int64_t)omp_get_thread_num() * (GC) * Lcap;                               \
        head(q + bh * (GC) * (DC), kt + bh * (DC) * Lcap, v + bh * Lcap * (DC), out + bh * (GC) * (DC),  \
             s, lens[bh / H], Lcap, scale, (GC), (DC));                                                \
    }

int decode_attention_f32(const float *q, const float *kt, const float *v, const int64_t *lens, float *out,
                         float *scratch, int64_t B, int64_t H, int64_t G, int64_t D, int64_t Lcap,
                         float scale, int threads) {
    if (G < 1 || G > GMAX || D < 1 || D > 128 || threads < 1) return -1;
    DISPATCH(DECODE_ROWS)
    return 0;
}

/* Dynamic schedule: requests differ in length, and a long one's pairs must not all land on one thread. */
#define EXTEND_ROWS(GC, DC)                                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                             \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                           \
        const int64_t b = bh / H, h = bh % H;                                                          \
        float *s = scratch + (int64_t)omp_get_thread_num() * (GC) * Lcap;                               \
        for (int64_t t = q_start[b]; t < q_start[b + 1]; t++)                                          \
            head(q + (t * H + h) * (GC) * (DC), kt + bh * (DC) * Lcap, v + bh * Lcap * (DC),           \
                 out + (t * H + h) * (GC) * (DC), s, prefix[b] + (t - q_start[b]) + 1, Lcap, scale,     \
                 (GC), (DC));                                                                          \
    }

int extend_attention_f32(const float *q, const float *kt, const float *v, const int64_t *q_start,
                         const int64_t *prefix, float *out, float *scratch, int64_t B, int64_t H, int64_t G,
                         int64_t D, int64_t Lcap, float scale, int threads) {
    if (G < 1 || G > GMAX || D < 1 || D > 128 || threads < 1) return -1;
    DISPATCH(EXTEND_ROWS)
    return 0;
}
