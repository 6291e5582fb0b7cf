/* Decode attention over the dense decode cache, float32, one query token per request.
 *
 * For each (request row b, KV head h), the G query heads of the group are scored against the keys,
 * softmaxed, and weighted over the values. K is stored transposed (K^T rows are position-contiguous),
 * so scores build up 64 positions at a time in registers with vector FMAs over d, no horizontal sums;
 * K and V are each read once, and only up to the row's own length (a shorter row's padding is never
 * touched). G and D are compile-time constants in the common shapes, so the accumulators stay in
 * registers. Plain C vectorized by the compiler (omp simd; -ffast-math lets expf vectorize through
 * glibc's libmvec). Rows x heads are split over `threads` OpenMP threads (torch's own count; torch's
 * CPU build uses the same libgomp, so this shares its thread pool).
 *
 * q:       [B, H, G, D] contiguous, row order
 * kt:      [Bcap, H, D, Lcap] contiguous (K transposed; rows 0..B-1 used)
 * v:       [Bcap, H, Lcap, D] contiguous
 * lens:    [B] int64, keys to attend per row (1 <= len <= Lcap)
 * out:     [B, H, G, D] contiguous
 * scratch: threads * G * Lcap floats
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

/* One loop over (b, h) per specialization: G and D constant inside, so `head` unrolls. */
#define ROWS(GC, DC)                                                                                   \
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
    /* The group sizes and head dims of common Llama / Qwen / Mistral checkpoints; others: generic. */
    if (D == 32) {
        if (G == 1) { ROWS(1, 32) } else if (G == 2) { ROWS(2, 32) } else if (G == 4) { ROWS(4, 32) }
        else { ROWS(G, 32) }
    } else if (D == 64) {
        if (G == 1) { ROWS(1, 64) } else if (G == 2) { ROWS(2, 64) } else if (G == 3) { ROWS(3, 64) }
        else if (G == 4) { ROWS(4, 64) } else if (G == 7) { ROWS(7, 64) } else if (G == 8) { ROWS(8, 64) }
        else { ROWS(G, 64) }
    } else if (D == 128) {
        if (G == 1) { ROWS(1, 128) } else if (G == 2) { ROWS(2, 128) } else if (G == 3) { ROWS(3, 128) }
        else if (G == 4) { ROWS(4, 128) } else if (G == 7) { ROWS(7, 128) } else if (G == 8) { ROWS(8, 128) }
        else { ROWS(G, 128) }
    } else { ROWS(G, D) }
    return 0;
}
