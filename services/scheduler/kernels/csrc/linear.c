/* Linear layers with bfloat16 weights at decode sizes (CPU): out[t, n] = bf16(x[t]) . W[n], float32
 * accumulation, for the few rows of a small decode batch. oneDNN's bf16 GEMM (packed, AMX or
 * AVX512-BF16) is the right tool from a few dozen rows up, but at a handful it costs several times
 * what reading the weights does (a Xeon with AMX, SmolLM2-135M at batch 1: 36 ms of linears a step
 * against ~15 ms to stream its 270 MB of bf16 weights), so below a threshold the weights are read
 * here once, in their plain [N, K] layout, and dotted with every row while they are in L1.
 *   x:   [T, K] float32, rows ldx floats apart; each element is rounded to bf16 (nearest even) first,
 *        as the bf16 GEMM rounds its input, so both paths compute the same products
 *   w:   [N, K] bf16 (raw 16-bit words), contiguous
 *   out: [T, N] float32, contiguous
 * Work is split over blocks of NB output rows; within a block, the rows of x go TB at a time, so the
 * block's weights come from L1 after the first group. The weights are widened to float32 by a 16-bit
 * shift (any x86-64 vector unit), the sums kept in W lanes per row of x and added up once at the end.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 16 /* output rows per task */
#define TB 8  /* rows of x scored against a weight row at once (accumulators: TB x W floats) */
#define W 32  /* weights per step: one 64-byte cache line of bf16 */

static inline __attribute__((always_inline)) float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = nan ? (u | 0x00400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* out[t, n] for t in [0, R) (R a compile-time constant where called) and n in [n0, n1). */
static inline __attribute__((always_inline)) void block(const float *restrict xr, const uint16_t *restrict w,
                                                         int64_t K, float *restrict out, int64_t N, int64_t n0,
                                                         int64_t n1, const int64_t R) {
    const int64_t Kw = K - K % W;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *restrict wn = w + n * K;
        float acc[TB][W];
        for (int64_t t = 0; t < R; t++)
            for (int64_t i = 0; i < W; i++) acc[t][i] = 0.0f;
        for (int64_t k = 0; k < Kw; k += W) {
            float wv[W];
#pragma omp simd
            for (int64_t i = 0; i < W; i++) wv[i] = widen(wn[k + i]);
            for (int64_t t = 0; t < R; t++) {
#pragma omp simd
                for (int64_t i = 0; i < W; i++) acc[t][i] += wv[i] * xr[t * K + k + i];
            }
        }
        for (int64_t t = 0; t < R; t++) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < W; i++) s += acc[t][i];
            for (int64_t k = Kw; k < K; k++) s += widen(wn[k]) * xr[t * K + k];
            out[t * N + n] = s;
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* The same with AVX512-BF16's pairwise dot product (vdpbf16ps: 32 bf16 products into 16 float32 lanes
 * per instruction, no widening): two weight rows at a time (NR, a compile-time constant where called),
 * each load of x feeding both. xb: the rounded rows of x as bf16, [R, K]. */
static inline __attribute__((always_inline)) void block_dp(const uint16_t *restrict xb, const uint16_t *restrict w,
                                                            int64_t K, float *restrict out, int64_t N,
                                                            int64_t n, const int64_t NR, const int64_t R) {
    __m512 acc[2][TB];
    for (int64_t j = 0; j < NR; j++)
        for (int64_t t = 0; t < R; t++) acc[j][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += W) {
        const __mmask32 m = K - k >= W ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[2];
        for (int64_t j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_epi16(m, w + (n + j) * K + k);
        for (int64_t t = 0; t < R; t++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(m, xb + t * K + k);
            for (int64_t j = 0; j < NR; j++)
                acc[j][t] = _mm512_dpbf16_ps(acc[j][t], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    for (int64_t j = 0; j < NR; j++)
        for (int64_t t = 0; t < R; t++) out[t * N + n + j] = _mm512_reduce_add_ps(acc[j][t]);
}

static inline __attribute__((always_inline)) void rows_dp(const uint16_t *restrict xb, const uint16_t *restrict w,
                                                           int64_t K, float *restrict out, int64_t N, int64_t n0,
                                                           int64_t n1, const int64_t R) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) block_dp(xb, w, K, out, N, n, 2, R);
    if (n < n1) block_dp(xb, w, K, out, N, n, 1, R);
}
/* x's rows as the dot products read them: bf16 words for vdpbf16ps, else float32 */
typedef uint16_t xtype;
static inline void put_x(xtype *to, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    *to = (uint16_t)(u >> 16);
}
#define ROWS(R) rows_dp(xt, w, K, ot, N, n0, n1, R)
#else
typedef float xtype;
static inline void put_x(xtype *to, float f) { *to = f; }
#define ROWS(R) block(xt, w, K, ot, N, n0, n1, R)
#endif

/* Returns 0, or -1 when the rounded copy of x could not be allocated (nothing written). */
int linear_bf16w_f32(const float *x, int64_t ldx, int64_t T, const uint16_t *w, int64_t N, int64_t K,
                     float *out, int threads) {
    const int64_t blocks = (N + NB - 1) / NB;
    xtype *xr = malloc((size_t)(T * K) * sizeof(xtype));
    if (!xr) return -1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) put_x(xr + t * K + k, round_bf16(x[t * ldx + k]));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * NB, n1 = n0 + NB < N ? n0 + NB : N;
        for (int64_t t0 = 0; t0 < T; t0 += TB) {
            const xtype *xt = xr + t0 * K;
            float *ot = out + t0 * N;
            switch (T - t0 < TB ? T - t0 : TB) {
            case 1: ROWS(1); break;
            case 2: ROWS(2); break;
            case 3: ROWS(3); break;
            case 4: ROWS(4); break;
            case 5: ROWS(5); break;
            case 6: ROWS(6); break;
            case 7: ROWS(7); break;
            default: ROWS(TB); break;
            }
        }
    }
    free(xr);
    return 0;
}
