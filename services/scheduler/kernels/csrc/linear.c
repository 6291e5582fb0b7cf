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

/* Mid-size batches on AMX tiles (a decode batch of a few dozen rows up to a short prefill): oneDNN's packed
 * bf16 GEMM there costs about twice what streaming the weights does (SmolLM2-135M's four projections of a
 * layer at 64 rows, each layer's weights cold as in a step: 0.99 against 0.50 ms), so from BF16_SMALL_T rows to
 * TILES_MAX_T (cpu_linear.py) the weights are read once, in the tile layout below, each 16 x 32 block of them
 * feeding every row of x before the next is read.
 *   wp: w [N, K] bf16 repacked by linear_tiles_pack: per 16 outputs (N / 16 blocks) per 32 of K (K / 32), the
 *       1 KiB tile [16 pairs of k][16 outputs][2] (TDPBF16PS's B operand), the K tiles of a block in order,
 *       so a thread's share of the weights is one contiguous stream
 *   x:  [T, K] float32 or (x_bf16) bf16 rows ldx elements apart, rounded to bf16 (nearest even) as the packed
 *       GEMM rounds its input
 *   out: [T, N] bf16 (out_bf16) or float32, either way the float32 sums rounded to bf16 (nearest even), as the
 *        packed GEMM's bf16 output is: the two dtypes hold the same values (cpu_linear.py's `out_bf16`)
 * N and K multiples of 32. Per pair of output blocks (32 columns), 32 rows of x at a time: four accumulator
 * tiles, two of x, two of weights. During a pair's first rows each step fetches the weights' next two tiles
 * into L2 (the next pair's first after its last): the weights at 8-256 rows 5-17 % faster than fetching the
 * next pair's whole tiles into L1 a step at a time, which at K = 1,536 (96 KiB a pair) evicted the lines
 * in use from the 48 KiB L1 (SmolLM2-135M's four projections x 30 layers at 64 rows, weights cold:
 * 20.4 -> 17.0 ms, Xeon with AMX). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
int prefix_tiles_ready(void); /* attention.c: the kernel has granted this process the tile state */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gemm_tile_config;

int linear_tiles_pack(const uint16_t *w, uint16_t *wp, int64_t N, int64_t K, int threads) {
    if (N % 32 || K % 32 || N < 32 || K < 32) return -1;
    const int64_t KB = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *t = wp + (nb * KB + kb) * 512;
            for (int64_t kp = 0; kp < 16; kp++)
                for (int64_t n = 0; n < 16; n++) {
                    t[(kp * 16 + n) * 2] = w[(nb * 16 + n) * K + kb * 32 + 2 * kp];
                    t[(kp * 16 + n) * 2 + 1] = w[(nb * 16 + n) * K + kb * 32 + 2 * kp + 1];
                }
        }
    return 0;
}

/* x rounded to bf16 into xb [T16, K] (T16: T up to a multiple of 16, the extra rows zero), by this thread's
 * share of the rows (inside a parallel region). */
static inline void round_rows(const void *x, int64_t ldx, int x_bf16, int64_t T, int64_t T16, int64_t K,
                              uint16_t *xb) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T16; t++) {
        uint16_t *xr = xb + t * K;
        if (t >= T) {
            memset(xr, 0, (size_t)K * 2);
        } else if (x_bf16) {
            memcpy(xr, (const uint16_t *)x + t * ldx, (size_t)K * 2);
        } else {
            const float *xf = (const float *)x + t * ldx;
            for (int64_t k = 0; k < K; k += 16)
                _mm256_storeu_si256((__m256i *)(xr + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + k)));
        }
    }
}

/* Tiles 0-7 as 16 rows of 64 bytes: accumulators 0-3, rows of x 4-5, weights 6-7 (attention.c configures its
 * own the same way; release with _tile_release). */
static inline void tiles_config(void) {
    gemm_tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* c [32, 32] float32 = rows m0.. m0 + 31 of xb times output pair np's two blocks of weights (rows past T are
 * left as they were). */
static inline __attribute__((always_inline)) void tile_pair(const uint16_t *xb, const uint16_t *wp, int64_t T,
                                                            int64_t K, int64_t np, int64_t NP, int64_t m0,
                                                            float *c) {
    const int64_t KB = K / 32;
    const uint16_t *b0 = wp + 2 * np * KB * 512, *b1 = b0 + KB * 512;
    const int two = m0 + 16 < T; /* a second tile of rows */
    const uint16_t *a = xb + m0 * K;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; kb++) {
        if (m0 == 0 && (kb + 1 < KB || np + 1 < NP)) { /* the next kb's two tiles, into L2 */
            const char *p0 = kb + 1 < KB ? (const char *)(b0 + (kb + 1) * 512) : (const char *)(b1 + KB * 512);
            const char *p1 = p0 + KB * 1024;
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch(p0 + l, _MM_HINT_T1);
                _mm_prefetch(p1 + l, _MM_HINT_T1);
            }
        }
        _tile_loadd(4, a + kb * 32, K * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + 16 * K + kb * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

/* 16 float32 sums rounded to bf16 (nearest even) and widened back: the values the GEMM's output holds. */
static inline __attribute__((always_inline)) __m256i rounded(const float *c) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c));
}
static inline __attribute__((always_inline)) __m512i widened(__m256i bf) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16);
}

/* Returns 0; -1 for shapes it does not take or without the tile state, -2 when the copy of x could not be
 * allocated (nothing written either way). */
int linear_tiles(const void *x, int64_t ldx, int x_bf16, int64_t T, const uint16_t *wp, int64_t N, int64_t K,
                 void *out, int out_bf16, int threads) {
    if (N % 32 || K % 32 || N < 32 || K < 32 || T < 1 || !prefix_tiles_ready()) return -1;
    const int64_t NP = N / 32, T16 = (T + 15) / 16 * 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(T16 * K) * 2);
    if (!xb) return -2;
#pragma omp parallel num_threads(threads)
    {
        round_rows(x, ldx, x_bf16, T, T16, K, xb);
        tiles_config();
        float c[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t np = 0; np < NP; np++)
            for (int64_t m0 = 0; m0 < T; m0 += 32) {
                tile_pair(xb, wp, T, K, np, NP, m0, c);
                const int64_t mr = T - m0 < 32 ? T - m0 : 32;
                for (int64_t r = 0; r < mr; r++)
                    for (int64_t h = 0; h < 32; h += 16) {
                        const __m256i bf = rounded(c + r * 32 + h);
                        if (out_bf16)
                            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (m0 + r) * N + np * 32 + h), bf);
                        else /* the rounded value widened back: a bf16 number, as oneDNN's bf16 GEMM gives */
                            _mm512_storeu_si512((float *)out + (m0 + r) * N + np * 32 + h, widened(bf));
                    }
            }
        _tile_release();
    }
    free(xb);
    return 0;
}

/* Greedy decoding's lm_head: out[t] = the index linear_tiles' output row t would give argmax_rows_f32 (the
 * first maximum of the bf16-rounded sums; the first NaN when the row has one), without writing the [T, N]
 * logits (a decode batch of 64 rows over a 49,152-entry vocabulary: 12.6 MB written and read again).
 * Each thread keeps, per row, 16 lanes of (largest value, its first column) over its columns (a lane's
 * columns come in ascending order, and only a strictly larger value replaces) and its first NaN; the lanes
 * and then the threads, whose columns ascend with the thread number under the static schedule, are merged
 * in order at the end. NaN and -inf are told by their bits: the library is built with -ffast-math.
 * Returns as linear_tiles does. */
int linear_tiles_argmax(const void *x, int64_t ldx, int x_bf16, int64_t T, const uint16_t *wp, int64_t N,
                        int64_t K, int64_t *out, int threads) {
    if (N % 32 || K % 32 || N < 32 || K < 32 || T < 1 || threads < 1 || !prefix_tiles_ready()) return -1;
    const int64_t NP = N / 32, T16 = (T + 15) / 16 * 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(T16 * K) * 2);
    /* per thread and row: the lanes' values and columns [16] each, the merged (value, column, first NaN) */
    float *lane_v = aligned_alloc(64, (size_t)(threads * T) * 16 * 4);
    int32_t *lane_i = aligned_alloc(64, (size_t)(threads * T) * 16 * 4);
    float *best_v = malloc((size_t)(threads * T) * 4);
    int64_t *best_i = malloc((size_t)(threads * T) * 8), *nan_i = malloc((size_t)(threads * T) * 8);
    int rc = 0, used = threads;
    if (!xb || !lane_v || !lane_i || !best_v || !best_i || !nan_i) {
        rc = -2;
        goto done;
    }
#pragma omp parallel num_threads(threads)
    {
        round_rows(x, ldx, x_bf16, T, T16, K, xb);
        tiles_config();
        const int me = omp_get_thread_num();
#pragma omp single
        used = omp_get_num_threads();
        float *lv = lane_v + (int64_t)me * T * 16;
        int32_t *li = lane_i + (int64_t)me * T * 16;
        int64_t *ni = nan_i + (int64_t)me * T, first = -1; /* first: this thread's first column */
        const __m512 neg_inf = _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)0xff800000u));
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
        for (int64_t r = 0; r < T; r++) {
            _mm512_store_ps(lv + r * 16, neg_inf);
            _mm512_store_si512(li + r * 16, _mm512_set1_epi32(-1));
            ni[r] = -1;
        }
        float c[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t np = 0; np < NP; np++) {
            if (first < 0) first = np * 32;
            for (int64_t m0 = 0; m0 < T; m0 += 32) {
                tile_pair(xb, wp, T, K, np, NP, m0, c);
                const int64_t mr = T - m0 < 32 ? T - m0 : 32;
                for (int64_t r = 0; r < mr; r++) {
                    const int64_t row = m0 + r;
                    __m512 v_max = _mm512_load_ps(lv + row * 16);
                    __m512i v_col = _mm512_load_si512(li + row * 16);
                    for (int64_t h = 0; h < 32; h += 16) {
                        const __m512i bits = widened(rounded(c + r * 32 + h));
                        const __m512 v = _mm512_castsi512_ps(bits);
                        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, abs_bits), inf_bits);
                        if (nan && ni[row] < 0) ni[row] = np * 32 + h + __builtin_ctz(nan);
                        const __mmask16 gt = _mm512_cmp_ps_mask(v, v_max, _CMP_GT_OQ);
                        v_max = _mm512_mask_mov_ps(v_max, gt, v);
                        v_col = _mm512_mask_mov_epi32(v_col, gt, _mm512_add_epi32(iota, _mm512_set1_epi32(
                                                                                    (int32_t)(np * 32 + h))));
                    }
                    _mm512_store_ps(lv + row * 16, v_max);
                    _mm512_store_si512(li + row * 16, v_col);
                }
            }
        }
        _tile_release();
        /* this thread's answer per row: the largest of its lanes at the least column (a row of -inf only:
         * its first column); -1 when it had no columns */
        for (int64_t r = 0; r < T; r++) {
            const __m512 v_max = _mm512_load_ps(lv + r * 16);
            const float m = _mm512_reduce_max_ps(v_max);
            const __mmask16 at = _mm512_cmp_ps_mask(v_max, _mm512_set1_ps(m), _CMP_EQ_OQ);
            const int32_t col = _mm512_mask_reduce_min_epi32(at, _mm512_load_si512(li + r * 16));
            best_v[(int64_t)me * T + r] = m;
            best_i[(int64_t)me * T + r] = first < 0 ? -1 : col < 0 ? first : col;
        }
    }
    for (int64_t r = 0; r < T; r++) { /* the threads' answers, in column order */
        int64_t at = -1, nan_at = -1;
        float m = 0.f;
        for (int t = 0; t < used && nan_at < 0; t++) {
            const int64_t i = best_i[(int64_t)t * T + r];
            if (nan_i[(int64_t)t * T + r] >= 0)
                nan_at = nan_i[(int64_t)t * T + r];
            else if (i >= 0 && (at < 0 || best_v[(int64_t)t * T + r] > m))
                at = i, m = best_v[(int64_t)t * T + r];
        }
        out[r] = nan_at >= 0 ? nan_at : at;
    }
done:
    free(xb);
    free(lane_v);
    free(lane_i);
    free(best_v);
    free(best_i);
    free(nan_i);
    return rc;
}
#else
int linear_tiles_pack(const uint16_t *w, uint16_t *wp, int64_t N, int64_t K, int threads) {
    (void)w, (void)wp, (void)N, (void)K, (void)threads;
    return -1;
}
int linear_tiles(const void *x, int64_t ldx, int x_bf16, int64_t T, const uint16_t *wp, int64_t N, int64_t K,
                 void *out, int out_bf16, int threads) {
    (void)x, (void)ldx, (void)x_bf16, (void)T, (void)wp, (void)N, (void)K, (void)out, (void)out_bf16, (void)threads;
    return -1;
}
int linear_tiles_argmax(const void *x, int64_t ldx, int x_bf16, int64_t T, const uint16_t *wp, int64_t N,
                        int64_t K, int64_t *out, int threads) {
    (void)x, (void)ldx, (void)x_bf16, (void)T, (void)wp, (void)N, (void)K, (void)out, (void)threads;
    return -1;
}
#endif
