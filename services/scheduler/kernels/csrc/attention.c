/* Attention kernels for CPU: float32 queries and outputs (the entry points' `_f32`), the KV cache (pool,
 * dense decode rows, shared prefixes) in float32, bfloat16 or fp8 (`kv`). Decode reads the dense decode
 * cache, and prefill (extend) reads each request's keys, copied from the KV pool into a per-thread
 * float32 tile. Both are the same per-query routine, `head`; extend runs several new tokens of a request
 * through it at once (`block`).
 *
 * `head` takes one query token's G query heads (the group of one KV head), scores them against that
 * KV head's keys [0, len), softmaxes, and weights the values. K is stored transposed (K^T: positions
 * contiguous per d; in the dense decode rows, in blocks of KT_BLOCK positions, kt_at), so scores build up
 * 64 positions at a time in registers with vector FMAs over d,
 * no horizontal sums; K and V are each read once per query (per block of queries in `block`), and only
 * up to `len` (padding past it is never touched). G and D are compile-time constants in the common shapes, so the accumulators stay in
 * registers. Plain C vectorized by the compiler (omp simd; -ffast-math lets expf vectorize through
 * glibc's libmvec). Work is split over `threads` OpenMP threads (torch's own count; torch's CPU build
 * uses the same libgomp, so this shares its thread pool).
 *
 * decode_attention_f32: one query per request, visited in the order order[0..B) (NULL: batch order;
 *   the wrapper puts requests that share a prefix next to each other, so that the prefix is still in
 *   cache when the next one reads it); request b's keys are in dense row r = rows[b] (rows ==
 *   NULL: r = b): lens[r] keys, plen[r] of them from a shared prefix buffer (one copy for every row
 *   whose request shares that prompt prefix; entry == NULL: none), the rest from the row's own buffer,
 *   starting at its index 0. With the batch's keys far larger than the cache, the kernel waits on
 *   memory unless the next (request, KV head)'s keys are prefetched while this one computes: -16 %
 *   at 64 rows of ~360 keys (4.5M-parameter model). Into L2, not L1 (prefetcht1): the next task's K
 *   and V (96 KB at 384 keys of SmolLM2's heads in bf16) do not fit in L1 beside the ones being read,
 *   so prefetching them there evicted this task's lines; 30 layers x 64 rows x ~390 keys, bf16, 2
 *   threads (Xeon, AMX): 33-35 -> 30-31 ms, 10 % less at 100 and 1,000 keys and at 8 rows, 3 % in float32.
 *   q [B, H, G, D] with rows q_stride floats apart; kt [Bcap, H] of D x Lcap in blocks (kt_at; Lcap a multiple
 *   of KT_BLOCK); v [Bcap, H, Lcap, D];
 *   out [B, H, G, D]; pk [E, H, D, Pcap]; pv [E, H, Pcap, D] (in PREFIX_KV of the kind); lens, entry, plen [Bcap]
 *   kn, vn (or NULL): the step's new keys and values [B, H, D], rows kn_stride / vn_stride floats apart,
 *   written at new_pos[b] of each row first (and, pool_k not NULL, into pool slots loc[b] of the KV pool
 *   pool_k / pool_v [S, H, D]): the store and the read of a row are one pass.
 * extend_attention_f32: request b's new tokens q_start[b] .. q_start[b+1]-1 follow prefix[b] cached
 *   ones; its i-th new token sees keys [0, prefix[b] + i] (causal after the prefix), read from the KV
 *   pool through its slots.
 * window (both; 0: none): a layer's sliding window. The query at position p sees only keys j with
 *   p - window < j <= p (HF's semantics), so every query's keys are one contiguous run that starts at
 *   max(0, p + 1 - window): the kernels offset their K^T / V pointers to that start (K^T rows keep
 *   their stride), which costs nothing and reads only the window. Requests run one (b, KV head) pair per task, so a request's K/V stay in
 *   cache while all its queries read them.
 *   q: token t's [H, G, D] at q + t * q_stride (T = q_start[B] tokens); pool_k, pool_v [S, H, D]; slots
 *   [B, Lcap]; out [T, H, G, D]
 * scratch: threads * G * (Pcap + Lcap) floats for decode, threads * (max(G, XQ) + 2 D) * Lcap for
 * extend.
 * kv (all three entry points): what the KV buffers (kt, v, pk, pv, pool_k, pool_v) hold, KV_F32 .. KV_E5M2
 * below. bfloat16 the kernels widen to float32 as they load (a 16-bit shift: any x86-64 vector unit does it;
 * with AVX-512, 32 at a time: scores_x16, weigh_x16) and round to nearest even as `put` stores; fp8 likewise
 * (with AVX-512 through the fp16 conversion, 16 at a time: scores_x8, weigh_x8; stores saturate). A decode
 * step's attention reads every key of the batch once and waits on memory, so half the bytes is about half
 * its time (fp8 after bf16: less, its widening takes more instructions); arithmetic stays float32 throughout.
 * All int64 except `threads` and `kv`; all arrays contiguous.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#define BL 64
#define GMAX 16
#define XQ 8 /* query rows per extend block: new tokens x G */
#define DMAX 256 /* head_dim (Gemma 3: 256) */

/* What a KV buffer holds (`kv` of the entry points; KV, SKV, DKV: the same as a compile-time constant). fp8
 * is OCP's E4M3 (largest 448; its NaN code 0x7f, stored only for a NaN, reads back as 480: restoring it cost
 * the decode loop 13 %) or E5M2 (fp16's upper byte), without a scale. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };
#define KV_SIZE(KV) ((KV) == KV_F32 ? 4 : (KV) == KV_BF16 ? 2 : 1)
/* What shared-prefix copies (pk, pv) hold for a kind: the same, but bf16 for fp8. Every fp8 value is a bf16
 * one, so the same keys; the copies stay in cache while each of their rows reads them, and there the time
 * goes to widening, which takes bf16 two instructions per 32 keys against fp8's eight or ten. */
#define PREFIX_KV(KV) ((KV) == KV_E4M3 || (KV) == KV_E5M2 ? KV_BF16 : (KV))
/* A flag of `kv`: attention runs on AMX tiles (below). For decode: the shared-prefix copies (bf16) are in the
 * tile layout and their part of attention goes there; for extend: all of it, over a bf16 or fp8 pool. */
#define KV_TILES 16
#define KV_KIND(kv) ((kv) & (KV_TILES - 1))
#define TILE_CHUNK 16 /* requests of one prefix per tile task, at most */
#define EXTEND_TASKS 4      /* extend on tiles: tasks per thread at least, where the requests allow */
#define EXTEND_MIN_ROWS 256 /* extend on tiles: query rows of a request's run, at least */

/* fp8 code c (E4M3 or E5M2) as float32, exactly (subnormals by an integer's conversion, so no
 * flush-to-zero setting can lose them). */
static inline __attribute__((always_inline)) float fp8_value(uint32_t c, const int KV) {
    const uint32_t m = c & 0x7fu;
    uint32_t u;
    float f;
    if (KV == KV_E4M3) {
        const uint32_t e = m >> 3, man = m & 7u;
        f = (float)man * 0x1p-9f;
        __builtin_memcpy(&u, &f, 4);
        u = e ? ((e + 120u) << 23) | (man << 20) : u; /* 0x7f (NaN) reads as 480, as fp8x16 reads it */
    } else {
        const uint32_t e = m >> 2, man = m & 3u;
        f = (float)man * 0x1p-16f;
        __builtin_memcpy(&u, &f, 4);
        u = e ? (e == 31u ? 0x7f800000u | (man << 21) : ((e + 112u) << 23) | (man << 21)) : u;
    }
    u |= (c & 0x80u) << 24;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* x as an fp8 code: rounded to nearest even, saturated at the largest finite value (448 / 57344; an
 * overflow is not an infinity, as in the usual fp8 KV stores), a NaN kept a NaN. Subnormals round by a
 * float addition whose last place is their step (the usual trick), the rest on the bits. */
static inline __attribute__((always_inline)) uint8_t fp8_code(float x, const int KV) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 24) & 0x80u, a_bits = u & 0x7fffffffu;
    if (a_bits > 0x7f800000u) return (uint8_t)(sign | 0x7fu); /* NaN (checked on the bits: -ffast-math) */
    float a;
    __builtin_memcpy(&a, &a_bits, 4);
    const int e4 = KV == KV_E4M3;
    const float top = e4 ? 448.0f : 57344.0f, tiny = e4 ? 0x1p-6f : 0x1p-14f, step = e4 ? 0x1p14f : 0x1p7f;
    a = a < top ? a : top;
    if (a < tiny) {
        const float r = a + step;
        uint32_t rb, sb;
        __builtin_memcpy(&rb, &r, 4);
        __builtin_memcpy(&sb, &step, 4);
        return (uint8_t)(sign | (rb - sb));
    }
    __builtin_memcpy(&u, &a, 4);
    const int shift = e4 ? 20 : 21;
    u += ((uint32_t)(e4 ? 7 - 127 : 15 - 127) << 23) + ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
    return (uint8_t)(sign | (u >> shift));
}

/* A KV buffer's element i as float32. */
static inline __attribute__((always_inline)) float ld(const void *restrict p, int64_t i, const int KV) {
    if (KV == KV_F32) return ((const float *)p)[i];
    if (KV != KV_BF16) return fp8_value(((const uint8_t *)p)[i], KV);
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* Store x as element i of a KV buffer (bf16: rounded to nearest even; a NaN stays a NaN; fp8: fp8_code). */
static inline __attribute__((always_inline)) void st(void *restrict p, int64_t i, float x, const int KV) {
    if (KV == KV_F32) {
        ((float *)p)[i] = x;
        return;
    }
    if (KV != KV_BF16) {
        ((uint8_t *)p)[i] = fp8_code(x, KV);
        return;
    }
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    ((uint16_t *)p)[i] = (uint16_t)(nan ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The address of element i of a KV buffer. */
#define KV_AT(p, i, KV) ((void *)((char *)(p) + (int64_t)(i) * KV_SIZE(KV)))

/* The dense decode rows keep K^T in blocks of KT_BLOCK positions: dim d of position p at kt_at(d, p, D), so a
 * block (all of d) is one contiguous run and a row's keys are one stream. Rows with K^T as [D][Lcap] read
 * their keys at 16.5-18 GB/s on two threads of the development Xeon wherever a row was shorter than Lcap
 * (the tail past its length broke the hardware prefetchers' streams; the cache grows Lcap by doubling), and
 * at 25.5 only with Lcap equal to the length; blocked, at 25-30 whatever the length (SmolLM2's heads,
 * bf16, 384 keys). Lcap is a multiple of KT_BLOCK. The shared-prefix copies and the extend tiles keep the
 * [D][cap] layout (`blk` 0 where a function takes both). */
#define KT_BLOCK 64
static inline __attribute__((always_inline)) int64_t kt_at(int64_t d, int64_t p, int64_t D) {
    return (p / KT_BLOCK) * KT_BLOCK * D + d * KT_BLOCK + p % KT_BLOCK;
}

/* One vector load of `width` (16 or 32) keys from position p of a K^T, the first `want` of them wanted: the
 * lanes *ma at element *at of d = 0 (the others follow a d-stride apart); blocked (blk), the lanes past p's
 * block come from the next block, lanes *mb at element *bt (*bt -1: none). */
static inline __attribute__((always_inline)) void key_lanes(int64_t p, int64_t want, int64_t width, int64_t D,
                                                            int blk, int64_t *at, int64_t *bt, uint32_t *ma,
                                                            uint32_t *mb) {
    const int64_t k = want < 0 ? 0 : want > width ? width : want, first = KT_BLOCK - p % KT_BLOCK;
    *ma = k == 32 ? 0xffffffffu : (1u << k) - 1u;
    *at = blk ? kt_at(0, p, D) : p;
    *bt = -1;
    *mb = 0;
    if (blk && first < width) {
        const uint32_t lo = (1u << first) - 1u;
        *bt = kt_at(0, p + first, D) - first;
        *mb = *ma & ~lo;
        *ma &= lo;
    }
}

/* The C side of the kinds' codecs, for the tests: fp8 codes [n] -> float32 values, and back. */
void fp8_decode(const uint8_t *c, float *out, int64_t n, int kv) {
    for (int64_t i = 0; i < n; i++) out[i] = kv == KV_E4M3 ? fp8_value(c[i], KV_E4M3) : fp8_value(c[i], KV_E5M2);
}
void fp8_encode(const float *x, uint8_t *out, int64_t n, int kv) {
    for (int64_t i = 0; i < n; i++) out[i] = kv == KV_E4M3 ? fp8_code(x[i], KV_E4M3) : fp8_code(x[i], KV_E5M2);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) /* every AVX-512 CPU but the Xeon Phi */
#define X16 1
#include <immintrin.h>
/* bf16 K^T and V rows 32 elements per 512-bit load: shifting each 32-bit lane left by 16 gives the even
 * elements as float32, clearing its low half the odd ones, two instructions where the compiler's
 * widening took four and an extract per 32. The sums are kept even/odd apart and interleaved once per
 * block of keys (scores) or per call (weigh); each sum sees the same products in the same order as the
 * portable loops do. */
static inline __attribute__((always_inline)) __m512 bf_even(__m512i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
static inline __attribute__((always_inline)) __m512 bf_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}
/* Lanes 0..15 (lo) and 16..31 (hi) of the interleave of e (even elements) and o (odd ones), and back. */
#define X16_LO _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
#define X16_HI _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8)
#define X16_EV _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0)
#define X16_OD _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1)
#define X16_SCORES(G) ((G) <= 8)                          /* 2 * G or 4 * G accumulators of 32 */
#define X16_WEIGH(G, D) ((D) % 32 == 0 && (G) * (D) <= 384) /* G * D / 16 accumulators, at most 24 */

/* `scores` for bf16 K^T; a last block that would read past `cap` loads only its keys. blk: K^T in blocks
 * (kt_at); 32 keys that cross a block's end load as two masked halves. */
static inline __attribute__((always_inline)) void scores_x16(const float *restrict qb, const uint16_t *restrict kb,
                                                             int64_t off, int64_t n_keys, int64_t cap,
                                                             float *restrict s, int64_t S, float scale,
                                                             const int64_t G, const int64_t D,
                                                             const uint16_t *restrict pf, const int blk) {
    const int64_t NV = G > 4 ? 1 : 2, W = 32 * NV, step = blk ? KT_BLOCK : cap; /* between two d */
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < n_keys; l0 += W) {
        /* vector v loads lanes ma[v] at kb + at[v] + d * step, and (bt[v] >= 0) lanes mb[v] at kb + bt[v] + .. */
        int64_t at[2], bt[2];
        __mmask32 ma[2], mb[2];
        const int64_t left = blk || off + l0 + W <= cap ? W : n_keys - l0; /* keys this block may load */
        for (int64_t v = 0; v < NV; v++) {
            uint32_t a, b;
            key_lanes(off + l0 + 32 * v, blk ? n_keys - l0 - 32 * v : left - 32 * v, 32, D, blk, &at[v], &bt[v],
                      &a, &b);
            ma[v] = (__mmask32)a, mb[v] = (__mmask32)b;
        }
        __m512 ae[8][2], ao[8][2];
        for (int64_t g = 0; g < G; g++)
            for (int64_t v = 0; v < NV; v++) ae[g][v] = ao[g][v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            __m512 e[2], o[2];
            for (int64_t v = 0; v < NV; v++) {
                if (pf) __builtin_prefetch(pf + at[v] + d * step, 0, 2);
                __m512i r = _mm512_maskz_loadu_epi16(ma[v], kb + at[v] + d * step);
                if (bt[v] >= 0) {
                    if (pf) __builtin_prefetch(pf + bt[v] + 31 + d * step, 0, 2);
                    r = _mm512_or_si512(r, _mm512_maskz_loadu_epi16(mb[v], kb + bt[v] + d * step));
                }
                e[v] = bf_even(r);
                o[v] = bf_odd(r);
            }
            for (int64_t g = 0; g < G; g++) {
                const __m512 qd = _mm512_set1_ps(qb[g * D + d]);
                for (int64_t v = 0; v < NV; v++) {
                    ae[g][v] = _mm512_fmadd_ps(qd, e[v], ae[g][v]);
                    ao[g][v] = _mm512_fmadd_ps(qd, o[v], ao[g][v]);
                }
            }
        }
        const int64_t n = n_keys - l0 < W ? n_keys - l0 : W;
        for (int64_t g = 0; g < G; g++)
            for (int64_t v = 0; v < NV; v++) {
                const __m512 a = _mm512_mul_ps(ae[g][v], sc), b = _mm512_mul_ps(ao[g][v], sc);
                for (int64_t half = 0; half < 2; half++) {
                    const int64_t first = 32 * v + 16 * half, cnt = n - first < 0 ? 0 : n - first > 16 ? 16 : n - first;
                    const __m512 x = _mm512_permutex2var_ps(a, half ? X16_HI : X16_LO, b);
                    _mm512_mask_storeu_ps(s + g * S + l0 + first, (__mmask16)((1u << cnt) - 1u), x);
                }
            }
    }
}

/* `weigh` for a bf16 V: acc[g] += sum_l p[g * S + l] V[off + l], D / 32 loads a key. */
static inline __attribute__((always_inline)) void weigh_x16(float acc[GMAX][DMAX], const float *restrict p, int64_t S,
                                                             const uint16_t *restrict vb, int64_t off, int64_t n,
                                                             const int64_t G, const int64_t D,
                                                             const uint16_t *restrict pf) {
    const int64_t NV = D / 32;
    __m512 ae[12], ao[12]; /* [g * NV + v] (G * NV <= 12): elements 32 v + 2 i (ae), 32 v + 2 i + 1 (ao) of acc[g] */
    for (int64_t g = 0; g < G; g++)
        for (int64_t v = 0; v < NV; v++) {
            const __m512 a = _mm512_loadu_ps(acc[g] + 32 * v), b = _mm512_loadu_ps(acc[g] + 32 * v + 16);
            ae[g * NV + v] = _mm512_permutex2var_ps(a, X16_EV, b);
            ao[g * NV + v] = _mm512_permutex2var_ps(a, X16_OD, b);
        }
    for (int64_t l = 0; l < n; l++) {
        const uint16_t *row = vb + (off + l) * D;
        if (pf)
            for (int64_t c = 0; c < D; c += 32) __builtin_prefetch(pf + l * D + c, 0, 2);
        __m512 e[8], o[8];
        for (int64_t v = 0; v < NV; v++) {
            const __m512i r = _mm512_loadu_si512(row + 32 * v);
            e[v] = bf_even(r);
            o[v] = bf_odd(r);
        }
        for (int64_t g = 0; g < G; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * S + l]);
            for (int64_t v = 0; v < NV; v++) {
                ae[g * NV + v] = _mm512_fmadd_ps(pg, e[v], ae[g * NV + v]);
                ao[g * NV + v] = _mm512_fmadd_ps(pg, o[v], ao[g * NV + v]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t v = 0; v < NV; v++) {
            _mm512_storeu_ps(acc[g] + 32 * v, _mm512_permutex2var_ps(ae[g * NV + v], X16_LO, ao[g * NV + v]));
            _mm512_storeu_ps(acc[g] + 32 * v + 16, _mm512_permutex2var_ps(ae[g * NV + v], X16_HI, ao[g * NV + v]));
        }
}
#endif

#if defined(__AVX512VL__)
#define X8 1
/* 16 fp8 codes as float32, E4M3's divided by 256 (fp8_value / FP8_UNIT). E5M2 is fp16's upper byte, and
 * E4M3 is fp16 once its 7 magnitude bits move up one place, 2^-8 times its value; so both widen through
 * the CPU's fp16 conversion (exact, subnormals included, whatever flush-to-zero says), E4M3 in three
 * instructions: the signed widening puts the sign in bit 15 (and 14, cleared). The callers take the
 * FP8_UNIT into the scale of the scores and around the weighted sum (once a call, not a key): a power
 * of two, so the same sums, bit for bit.
 * 30 layers x 64 rows x ~390 keys (SmolLM2's heads), 2 threads, Xeon: E4M3 24.1 ms, E5M2 23.6, bf16 32.3. */
#define FP8_UNIT(KV) ((KV) == KV_E4M3 ? 256.0f : 1.0f)
static inline __attribute__((always_inline)) __m512 fp8x16(__m128i c, const int KV) {
    if (KV == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                            _mm256_set1_epi16((short)0xbfff)));
}
#define X8_SCORES(G) ((G) <= 8)                           /* 4 * G or 2 * G accumulators of 16 */
#define X8_WEIGH(G, D) ((D) % 16 == 0 && (G) * (D) <= 320) /* G * D / 16 accumulators, at most 20 */

/* `scores` for fp8 K^T, 16 keys a load; a last block that would read past `cap` loads only its keys. blk: K^T
 * in blocks (kt_at); 16 keys that cross a block's end load as two masked halves. */
static inline __attribute__((always_inline)) void scores_x8(const float *restrict qb, const uint8_t *restrict kb,
                                                            int64_t off, int64_t n_keys, int64_t cap,
                                                            float *restrict s, int64_t S, float scale,
                                                            const int64_t G, const int64_t D,
                                                            const uint8_t *restrict pf, const int KV, const int blk) {
    const int64_t NV = G > 4 ? 2 : 4, W = 16 * NV, step = blk ? KT_BLOCK : cap; /* between two d */
    const __m512 sc = _mm512_set1_ps(scale * FP8_UNIT(KV));
    for (int64_t l0 = 0; l0 < n_keys; l0 += W) {
        /* vector v loads lanes ma[v] at kb + at[v] + d * step, and (bt[v] >= 0) lanes mb[v] at kb + bt[v] + .. */
        int64_t at[4], bt[4];
        __mmask16 ma[4], mb[4];
        const int64_t left = blk || off + l0 + W <= cap ? W : n_keys - l0; /* keys this block may load */
        for (int64_t v = 0; v < NV; v++) {
            uint32_t a, b;
            key_lanes(off + l0 + 16 * v, blk ? n_keys - l0 - 16 * v : left - 16 * v, 16, D, blk, &at[v], &bt[v],
                      &a, &b);
            ma[v] = (__mmask16)a, mb[v] = (__mmask16)b;
        }
        __m512 a[8][4];
        for (int64_t g = 0; g < G; g++)
            for (int64_t v = 0; v < NV; v++) a[g][v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            if (pf) /* W <= 64 keys: one line, two where they cross a block */
                for (int64_t v = 0; v < NV; v += blk ? 1 : NV) {
                    __builtin_prefetch(pf + at[v] + d * step, 0, 2);
                    if (bt[v] >= 0) __builtin_prefetch(pf + bt[v] + 15 + d * step, 0, 2);
                }
            __m512 k[4];
            for (int64_t v = 0; v < NV; v++) {
                __m128i c = _mm_maskz_loadu_epi8(ma[v], kb + at[v] + d * step);
                if (bt[v] >= 0) c = _mm_or_si128(c, _mm_maskz_loadu_epi8(mb[v], kb + bt[v] + d * step));
                k[v] = fp8x16(c, KV);
            }
            for (int64_t g = 0; g < G; g++) {
                const __m512 qd = _mm512_set1_ps(qb[g * D + d]);
                for (int64_t v = 0; v < NV; v++) a[g][v] = _mm512_fmadd_ps(qd, k[v], a[g][v]);
            }
        }
        const int64_t n = n_keys - l0 < W ? n_keys - l0 : W;
        for (int64_t g = 0; g < G; g++)
            for (int64_t v = 0; v < NV; v++) {
                const int64_t cnt = n - 16 * v < 0 ? 0 : n - 16 * v > 16 ? 16 : n - 16 * v;
                _mm512_mask_storeu_ps(s + g * S + l0 + 16 * v, (__mmask16)((1u << cnt) - 1u),
                                      _mm512_mul_ps(a[g][v], sc));
            }
    }
}

/* `weigh` for an fp8 V: acc[g] += sum_l p[g * S + l] V[off + l], D / 16 loads a key. */
static inline __attribute__((always_inline)) void weigh_x8(float acc[GMAX][DMAX], const float *restrict p, int64_t S,
                                                           const uint8_t *restrict vb, int64_t off, int64_t n,
                                                           const int64_t G, const int64_t D,
                                                           const uint8_t *restrict pf, const int KV) {
    const int64_t NV = D / 16;
    const __m512 unit = _mm512_set1_ps(FP8_UNIT(KV)), inv = _mm512_set1_ps(1.0f / FP8_UNIT(KV));
    __m512 a[20]; /* [g * NV + v]: elements 16 v .. 16 v + 15 of acc[g], over FP8_UNIT */
    for (int64_t g = 0; g < G; g++)
        for (int64_t v = 0; v < NV; v++) a[g * NV + v] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + 16 * v), inv);
    for (int64_t l = 0; l < n; l++) {
        const uint8_t *row = vb + (off + l) * D;
        if (pf)
            for (int64_t c = 0; c < D; c += 64) __builtin_prefetch(pf + l * D + c, 0, 2);
        __m512 x[20];
        for (int64_t v = 0; v < NV; v++) x[v] = fp8x16(_mm_loadu_si128((const __m128i *)(row + 16 * v)), KV);
        for (int64_t g = 0; g < G; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * S + l]);
            for (int64_t v = 0; v < NV; v++) a[g * NV + v] = _mm512_fmadd_ps(pg, x[v], a[g * NV + v]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t v = 0; v < NV; v++) _mm512_storeu_ps(acc[g] + 16 * v, _mm512_mul_ps(a[g * NV + v], unit));
}
#endif

/* s[g * S + l] = scale * q[g] . K[off + l] for l in [0, n); K^T rows of `cap` positions. Keys go 64 at a
 * time, 32 with more than 4 query rows, so the accumulators (rows x keys) stay in the registers.
 * pf (or NULL): another K^T of the same shape to prefetch, block by block, as this one is read. */
static inline __attribute__((always_inline)) void scores(const float *restrict qb, const void *restrict kb,
                                                          int64_t off, int64_t n_keys, int64_t cap,
                                                          float *restrict s, int64_t S, float scale,
                                                          const int64_t G, const int64_t D,
                                                          const void *restrict pf, const int KV, const int blk) {
    const int64_t W = G > 4 ? BL / 2 : BL, line = 64 / KV_SIZE(KV); /* elements per 64-byte cache line */
#ifdef X16
    if (KV == KV_BF16 && X16_SCORES(G)) {
        scores_x16(qb, kb, off, n_keys, cap, s, S, scale, G, D, pf, blk);
        return;
    }
#endif
#ifdef X8
    if ((KV == KV_E4M3 || KV == KV_E5M2) && X8_SCORES(G)) {
        scores_x8(qb, kb, off, n_keys, cap, s, S, scale, G, D, pf, KV, blk);
        return;
    }
#endif
    for (int64_t l0 = 0; l0 < n_keys; l0 += W) {
        float acc[GMAX][BL];
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < W; i++) acc[g][i] = 0.0f;
        /* full-width loads stay inside the buffer (past n_keys: ignored); blocked, inside one block */
        if (blk ? (off + l0) % KT_BLOCK + W <= KT_BLOCK : off + l0 + W <= cap) {
            for (int64_t d = 0; d < D; d++) {
                const int64_t at = blk ? kt_at(d, off + l0, D) : d * cap + off + l0;
                if (pf)
                    for (int64_t c = 0; c < W; c += line) __builtin_prefetch(KV_AT(pf, at + c, KV), 0, 2);
                for (int64_t g = 0; g < G; g++) {
                    const float qd = qb[g * D + d];
#pragma omp simd
                    for (int64_t i = 0; i < W; i++) acc[g][i] += qd * ld(kb, at + i, KV);
                }
            }
        } else {
            const int64_t n = n_keys - l0 < W ? n_keys - l0 : W;
            for (int64_t d = 0; d < D; d++)
                for (int64_t i = 0; i < n; i++) {
                    const float k = ld(kb, blk ? kt_at(d, off + l0 + i, D) : d * cap + off + l0 + i, KV);
                    for (int64_t g = 0; g < G; g++) acc[g][i] += qb[g * D + d] * k;
                }
        }
        const int64_t n = n_keys - l0 < W ? n_keys - l0 : W;
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < n; i++) s[g * S + l0 + i] = acc[g][i] * scale;
    }
}

/* In place over one query row's n scores. */
static inline __attribute__((always_inline)) void softmax(float *restrict sg, int64_t n) {
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t l = 1; l < n; l++) m = sg[l] > m ? sg[l] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < n; l++) {
        sg[l] = expf(sg[l] - m);
        sum += sg[l];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t l = 0; l < n; l++) sg[l] *= inv;
}

/* acc[g] += sum_l p[g * S + l] V[off + l] for l in [0, n); pf (or NULL): another V to prefetch meanwhile. */
static inline __attribute__((always_inline)) void weigh(float acc[GMAX][DMAX], const float *restrict p,
                                                         int64_t S, const void *restrict vb, int64_t off,
                                                         int64_t n, const int64_t G, const int64_t D,
                                                         const void *restrict pf, const int KV) {
#ifdef X16
    if (KV == KV_BF16 && X16_WEIGH(G, D)) {
        weigh_x16(acc, p, S, vb, off, n, G, D, pf);
        return;
    }
#endif
#ifdef X8
    if ((KV == KV_E4M3 || KV == KV_E5M2) && X8_WEIGH(G, D)) {
        weigh_x8(acc, p, S, vb, off, n, G, D, pf, KV);
        return;
    }
#endif
    const int64_t line = 64 / KV_SIZE(KV);
    for (int64_t l = 0; l < n; l++) {
        const int64_t at = (off + l) * D;
        if (pf)
            for (int64_t c = 0; c < D; c += line) __builtin_prefetch(KV_AT(pf, l * D + c, KV), 0, 2);
        for (int64_t g = 0; g < G; g++) {
            const float pg = p[g * S + l];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g][d] += pg * ld(vb, at + d, KV);
        }
    }
}

/* One query token against its keys: `plen` from a shared prefix buffer (pk/pv, `pcap` positions, from
 * position poff; none when plen is 0), then `len` of its own (kb/vb, `Lcap` positions, from position off). The keys are scored into one
 * array, so the softmax and the weighted sum see them in position order exactly as if one buffer held
 * them all. s: G rows of S >= plen + len floats. nk, nv (or NULL): the next task's own K^T and V, so
 * they are on their way from memory while this one computes. */
static inline __attribute__((always_inline)) void head(const float *restrict qb, const void *restrict pk,
                                                        const void *restrict pv, int64_t poff, int64_t plen,
                                                        int64_t pcap, const void *restrict kb,
                                                        const void *restrict vb, int64_t off, int64_t len,
                                                        int64_t Lcap, float *restrict ob,
                                                        float *restrict s, int64_t S, float scale,
                                                        const int64_t G, const int64_t D,
                                                        const void *restrict nk, const void *restrict nv,
                                                        const int PKV, const int KV, const int blk) {
    const int64_t total = plen + len;
    if (plen > 0) scores(qb, pk, poff, plen, pcap, s, S, scale, G, D, NULL, PKV, 0);
    scores(qb, kb, off, len, Lcap, s + plen, S, scale, G, D, nk, KV, blk);
    for (int64_t g = 0; g < G; g++) softmax(s + g * S, total);
    /* out[g] = sum_l p[g][l] V[l] */
    float acc[GMAX][DMAX];
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
    if (plen > 0) weigh(acc, s, S, pv, poff, plen, G, D, NULL, PKV);
    weigh(acc, s + plen, S, vb, off, len, G, D, nv, KV);
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) ob[g * D + d] = acc[g][d];
}

/* QB consecutive new tokens of one (request, KV head) at once, so each key loaded feeds QB * G query
 * rows instead of G: row r = i * G + g is token i's query head g (q rows `step`, out rows `ostep` floats
 * apart between tokens), and token i sees keys [lo_i, n0 + i) with lo_i = max(0, n0 + i - window) (window 0:
 * lo_i = 0). Each row's scores, softmax and weighted sum are what `head` computes for it alone; the
 * keys of the block's span outside a row's own get weight 0. s: QB * G rows of S floats. */
static inline __attribute__((always_inline)) void block(const float *restrict q0, int64_t step,
                                                         const float *restrict kb, const float *restrict vb,
                                                         int64_t n0, int64_t window, int64_t Lcap,
                                                         float *restrict o0, int64_t ostep, float *restrict s,
                                                         int64_t S, float scale, const int64_t QB, const int64_t G,
                                                         const int64_t D) {
    const int64_t R = QB * G, n = n0 + QB - 1;
    const int64_t base = window > 0 && n0 > window ? n0 - window : 0; /* the first token's first key */
    float qb[GMAX * DMAX];
    for (int64_t i = 0; i < QB; i++)
        for (int64_t j = 0; j < G * D; j++) qb[i * G * D + j] = q0[i * step + j];
    scores(qb, kb, base, n - base, Lcap, s, S, scale, R, D, NULL, 0, 0); /* s[.. l - base] for key l */
    for (int64_t r = 0; r < R; r++) {
        const int64_t own = n0 + r / G, lo = window > 0 && own > window ? own - window : 0;
        float *sr = s + r * S; /* sr[l - base]: key l */
        for (int64_t l = base; l < lo; l++) sr[l - base] = 0.0f;
        softmax(sr + (lo - base), own - lo);
        for (int64_t l = own; l < n; l++) sr[l - base] = 0.0f;
    }
    float acc[GMAX][DMAX];
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) acc[r][d] = 0.0f;
    weigh(acc, s, S, vb, base, n - base, R, D, NULL, 0);
    for (int64_t i = 0; i < QB; i++)
        for (int64_t j = 0; j < G * D; j++) o0[i * ostep + j] = acc[i * G + j / D][j % D];
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
    } else if (D == 256) {                                                                             \
        if (G == 1) { BODY(1, 256) } else if (G == 2) { BODY(2, 256) } else if (G == 4) { BODY(4, 256) } \
        else { BODY(G, 256) }                                                                          \
    } else { BODY(G, D) }

/* A decode step's new key and value of one (request, KV head), kn / vn (D floats each), written at
 * position p of its dense row (kt: that row's K^T, blocked: kt_at; vt: its V [Lcap][D]) and, pk_slot not NULL,
 * into its KV pool slot (pk_slot / pv_slot: D floats each). Done by the task that attends over the row
 * right after: a separate pass touched each row's D K^T lines while they were cold (one cache miss per
 * float written, ~150 us a layer at 64 requests), where here they are the lines `scores` reads next. */
static inline __attribute__((always_inline)) void put(const float *restrict kn, const float *restrict vn,
                                                       void *restrict kt, void *restrict vt, int64_t p,
                                                       void *restrict pk_slot, void *restrict pv_slot,
                                                       const int64_t D, const int KV) {
    for (int64_t d = 0; d < D; d++) st(kt, kt_at(d, p, D), kn[d], KV);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) st(vt, p * D + d, vn[d], KV);
    if (pk_slot) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            st(pk_slot, d, kn[d], KV);
            st(pv_slot, d, vn[d], KV);
        }
    }
}

/* Token t's new key and value (HD floats each at kn + t * kn_stride, vn + t * vn_stride) into slot loc[t] of
 * pool_k / pool_v ([S, H, D] of `kv`), stored as `put` stores them (bf16: nearest even; fp8: saturated). A
 * prefill's store: torch's dtype conversion and then index_copy_ were two passes, the second on one thread
 * (~14 ms of a 2,048-token prefill of SmolLM2-135M, 30 layers). */
#define STORE_ROWS(KV)                                                                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (T >= 64)")                     \
    for (int64_t t = 0; t < T; t++) {                                                                  \
        void *pk = KV_AT(pool_k, loc[t] * HD, KV), *pv = KV_AT(pool_v, loc[t] * HD, KV);               \
        const float *k = kn + t * kn_stride, *v = vn + t * vn_stride;                                  \
        _Pragma("omp simd") for (int64_t i = 0; i < HD; i++) {                                         \
            st(pk, i, k[i], KV);                                                                       \
            st(pv, i, v[i], KV);                                                                       \
        }                                                                                              \
    }

int store_kv_f32(const float *kn, int64_t kn_stride, const float *vn, int64_t vn_stride, const int64_t *loc,
                 void *pool_k, void *pool_v, int64_t T, int64_t HD, int kv, int threads) {
    if (kv == KV_F32)
        STORE_ROWS(KV_F32)
    else if (kv == KV_BF16)
        STORE_ROWS(KV_BF16)
    else if (kv == KV_E4M3)
        STORE_ROWS(KV_E4M3)
    else if (kv == KV_E5M2)
        STORE_ROWS(KV_E5M2)
    else
        return -1;
    return 0;
}

/* Request b's keys live in dense row r: plen[r] from shared prefix entry entry[r] (pk/pv: [E, H, D, Pcap] /
 * [E, H, Pcap, D]; entry may be NULL: no sharing), then lens[r] - plen[r] of its own. With a window, the
 * keys before lo = lens[r] - window are skipped: first the prefix's, then the row's own. With kn (else
 * NULL), the task first writes the step's new key and value at new_pos[b] of its row (`put`). */
#define DECODE_ROWS(GC, DC, KV)                                                                        \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                 \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                           \
        const int64_t i = bh / H, h = bh % H, b = order ? order[i] : i, r = rows ? rows[b] : b;        \
        if (kn)                                                                                        \
            put(kn + b * kn_stride + h * (DC), vn + b * vn_stride + h * (DC),                          \
                KV_AT(kt, (r * H + h) * (DC) * Lcap, KV), KV_AT(v, (r * H + h) * Lcap * (DC), KV),     \
                new_pos[b], pool_k ? KV_AT(pool_k, (loc[b] * H + h) * (DC), KV) : NULL,                \
                pool_k ? KV_AT(pool_v, (loc[b] * H + h) * (DC), KV) : NULL, (DC), KV);                 \
        const int64_t pl = entry ? plen[r] : 0;                                                        \
        const int64_t e = pl > 0 ? entry[r] : 0;                                                       \
        const int64_t lo = window > 0 && lens[r] > window ? lens[r] - window : 0;                      \
        const int64_t poff = lo < pl ? lo : pl, off = lo > pl ? lo - pl : 0;                           \
        const int64_t nb = bh + 1, nh = nb % H, ni = nb < B * H ? nb / H : 0;                         \
        const int64_t nbb = order ? order[ni] : ni, nr = rows ? rows[nbb] : nbb;                       \
        float *s = scratch + (int64_t)omp_get_thread_num() * (GC) * (Pcap + Lcap);                      \
        head(q + b * q_stride + h * (GC) * (DC), KV_AT(pk, (e * H + h) * (DC) * Pcap, PREFIX_KV(KV)),  \
             KV_AT(pv, (e * H + h) * Pcap * (DC), PREFIX_KV(KV)), poff, pl - poff, Pcap,               \
             KV_AT(kt, (r * H + h) * (DC) * Lcap, KV), KV_AT(v, (r * H + h) * Lcap * (DC), KV), off,    \
             lens[r] - pl - off, Lcap, out + (b * H + h) * (GC) * (DC), s, Pcap + Lcap, scale, (GC),    \
             (DC),                                                                                     \
             nb < B * H ? KV_AT(kt, (nr * H + nh) * (DC) * Lcap, KV) : NULL,                            \
             nb < B * H ? KV_AT(v, (nr * H + nh) * Lcap * (DC), KV) : NULL, PREFIX_KV(KV), KV, 1);      \
    }
#define DECODE_F32(GC, DC) DECODE_ROWS(GC, DC, KV_F32)
#define DECODE_BF16(GC, DC) DECODE_ROWS(GC, DC, KV_BF16)
#define DECODE_E4M3(GC, DC) DECODE_ROWS(GC, DC, KV_E4M3)
#define DECODE_E5M2(GC, DC) DECODE_ROWS(GC, DC, KV_E5M2)

/* Shared prefixes on AMX tiles (`kv` | KV_TILES; the CPU has AMX-BF16 and the kernel may use it:
 * prefix_tiles_ready). Every row reading one prefix scores the same keys, so the prefix part of their
 * attention is two small matrix products: scores = Q K^T over the rows of up to TILE_CHUNK requests (G query
 * heads each) at once, and their probabilities times V, on the tile unit (bf16 products, float32 sums). The
 * row's own keys, the softmax and the rest are as in `head`. Q and the prefix's probabilities are rounded to
 * bf16 for the products (the KV is bf16 already): the prefix part is no longer bit for bit what one buffer
 * would give, as with any batched GEMM. Per (request chunk, KV head) the prefix's K and V are read once
 * instead of once per request, and a tile product does 16 x 16 x 32 multiply-adds where a vector FMA does 16.
 * The copies are laid out as the tiles load them: K^T [E, H, D/2, Pcap, 2] (dimension pairs of each
 * position side by side), V [E, H, Pcap/2, D, 2] (position pairs of each dimension side by side), with
 * Pcap a multiple of 32 and V zero from the prefix's end to the next multiple of 32 (shared_prefix.py). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(X16)
#define TILES 1
#include <sys/syscall.h>
#include <unistd.h>
static int tiles_state; /* 0: not asked yet, 1: granted, -1: refused */
/* Linux hands out the tile registers' state to a process that asks (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); oneDNN asks too, this does not rely on it. */
int prefix_tiles_ready(void) {
    int st = __atomic_load_n(&tiles_state, __ATOMIC_ACQUIRE);
    if (st == 0) {
        st = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&tiles_state, st, __ATOMIC_RELEASE);
    }
    return st == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* out[0..n) = x[0..n) rounded to bf16 (nearest even, as `st`), 16 at a time (TILES implies AVX512-BF16). */
static inline __attribute__((always_inline)) void to_bf16(const float *restrict x, uint16_t *restrict out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) st(out, i, x[i], KV_BF16);
}

/* 2^t for 16 lanes, inline: 2^n p(f) with n = round(t), f = t - n in [-1/2, 1/2] and p a degree-4 fit of
 * 2^f there (relative error 2.8e-6: the tile paths round their probabilities to bf16, 2^-9, next); t below
 * -126 gives 2^-126. A call to libmvec's expf made the compiler spill a softmax's running sum around it every
 * 16 keys (a third of a prefill's attention on tiles, perf); the degree-6 e^x this replaces spent three more
 * operations a vector on the exponential, the largest part of the softmax. */
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.009560514241456985f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591703951358795f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
    return _mm512_scalef_ps(p, n);
}

/* The first n (<= 16, or more: all 16) lanes. */
static inline __attribute__((always_inline)) __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* The maximum of si[lo, hi) (-FLT_MAX where empty). Four running maxima: one waits on the previous
 * iteration's (the max's latency), which bounded the loop at a quarter of its load rate; a maximum does not
 * depend on the order it is taken in. */
static inline __attribute__((always_inline)) float scores_max(const float *restrict si, int64_t lo, int64_t hi) {
    __m512 m0 = _mm512_set1_ps(-FLT_MAX), m1 = m0, m2 = m0, m3 = m0;
    int64_t l = lo;
    for (; l + 64 <= hi; l += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(si + l));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(si + l + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(si + l + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(si + l + 48));
    }
    for (; l < hi; l += 16) {
        const __mmask16 k = lanes(hi - l);
        m0 = _mm512_mask_max_ps(m0, k, m0, _mm512_maskz_loadu_ps(k, si + l));
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

/* e^(si[l] sc - m) = 2^(si[l] sc log2(e) - m log2(e)) over [lo, hi) (sc2, m2: the factors times log2(e)),
 * added into the running sum, which it returns: into si[l] itself, or (pg not NULL) rounded to bf16 into
 * pg[l]. Whole vectors, then a masked last one. */
static inline __attribute__((always_inline)) __m512 scores_exp(float *restrict si, int64_t lo, int64_t hi, __m512 sc2,
                                                               __m512 m2, __m512 sum, uint16_t *restrict pg) {
    int64_t l = lo;
    for (; l + 16 <= hi; l += 16) {
        const __m512 e = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(si + l), sc2, m2));
        if (pg)
            _mm256_storeu_si256((__m256i *)(pg + l), (__m256i)_mm512_cvtneps_pbh(e));
        else
            _mm512_storeu_ps(si + l, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (l < hi) {
        const __mmask16 k = lanes(hi - l);
        const __m512 e = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, si + l), sc2, m2));
        if (pg)
            _mm256_mask_storeu_epi16(pg + l, k, (__m256i)_mm512_cvtneps_pbh(e));
        else
            _mm512_mask_storeu_ps(si + l, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return sum;
}

/* One query row of a tile task: the prefix's scores si[poff, pl) as the tiles left them (unscaled), then its
 * own scores si[pl, pl + own) (scaled). The softmax over both, normalized by the caller (it returns 1 / the
 * sum): the rest is linear in the probabilities, so the caller scales the row's output once instead of every
 * probability (FlashAttention's order). The own ones stay in si (float32), the prefix's go to pg as bf16, zero
 * outside [poff, pl) up to P32 (what the second product reads); the largest is 1. */
static inline __attribute__((always_inline)) float tile_softmax(float *restrict si, int64_t poff, int64_t pl,
                                                                int64_t own, float scale, uint16_t *restrict pg,
                                                                int64_t P32) {
    /* the largest scaled prefix score is the largest score scaled: rounding keeps the order (scale > 0) */
    const float mp = poff < pl ? scores_max(si, poff, pl) * scale : -FLT_MAX, mo = scores_max(si, pl, pl + own);
    const float l2e = 1.44269504088896341f, m2 = (mp > mo ? mp : mo) * l2e;
    /* the own scores are scaled already */
    const __m512 mv = _mm512_set1_ps(m2), sum0 = _mm512_setzero_ps();
    for (int64_t l = 0; l < poff; l++) pg[l] = 0;
    const __m512 sum = scores_exp(si, pl, pl + own, _mm512_set1_ps(l2e), mv,
                                  scores_exp(si, poff, pl, _mm512_set1_ps(scale * l2e), mv, sum0, pg), NULL);
    for (int64_t l = pl; l < P32; l++) pg[l] = 0;
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* C[16 mr, 16 n] (float32, ldc floats) = sum over `steps` of A[16 mr, 32] (bf16, lda elements; a step 32
 * on) times B[16 pairs, 16 n] (bf16 pairs, ldb elements; a step 16 rows on; its n column blocks 32 elements
 * apart); mr * n accumulators (tiles 0-3), mr = 1 with n = 4 or 1, mr = 2 with n = 2 or 1. A is in tiles 4
 * and 5, B in 6 and 7, each 16 rows of 64 bytes (the task's configuration). Several accumulators keep
 * products in flight where one would wait on the previous; two row blocks load each B tile once for both
 * (a long prompt's keys and values come from L2: one 2,048-token prompt's attention 7 % faster). */
static inline __attribute__((always_inline)) void tile_product(const uint16_t *a, int64_t lda, const uint16_t *b,
                                                                int64_t ldb, int64_t steps, float *c, int64_t ldc,
                                                                const int mr, const int n) {
    const int acc = mr * n; /* accumulators in use: 1, 2 or 4 */
    _tile_zero(0);
    if (acc > 1) _tile_zero(1);
    if (acc > 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < steps; k++) {
        const uint16_t *bk = b + 16 * k * ldb;
        _tile_loadd(4, a + 32 * k, lda * 2);
        if (mr == 2) {
            _tile_loadd(5, a + 16 * lda + 32 * k, lda * 2);
            _tile_loadd(6, bk, ldb * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (n == 2) {
                _tile_loadd(7, bk + 32, ldb * 2);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
            continue;
        }
        _tile_loadd(6, bk, ldb * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (n == 4) {
            _tile_loadd(7, bk + 32, ldb * 2);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, bk + 64, ldb * 2);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, bk + 96, ldb * 2);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    _tile_stored(0, c, ldc * 4);
    if (mr == 2) {
        _tile_stored(1, c + 16 * ldc, ldc * 4);
        if (n == 2) {
            _tile_stored(2, c + 16, ldc * 4);
            _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
        }
    } else if (n == 4) {
        _tile_stored(1, c + 16, ldc * 4);
        _tile_stored(2, c + 32, ldc * 4);
        _tile_stored(3, c + 48, ldc * 4);
    }
}

/* C[rows, cols] (rows 16 or 32, cols a multiple of 16) by tile_product: 32 rows two column blocks at a time,
 * 16 rows four while they fill. */
static inline __attribute__((always_inline)) void tile_rows(const uint16_t *a, int64_t lda, const uint16_t *b,
                                                             int64_t ldb, int64_t steps, float *c, int64_t ldc,
                                                             int64_t rows, int64_t cols) {
    int64_t n = 0;
    if (rows > 16) {
        for (; n + 32 <= cols; n += 32) tile_product(a, lda, b + 2 * n, ldb, steps, c + n, ldc, 2, 2);
        for (; n < cols; n += 16) tile_product(a, lda, b + 2 * n, ldb, steps, c + n, ldc, 2, 1);
        return;
    }
    for (; n + 64 <= cols; n += 64) tile_product(a, lda, b + 2 * n, ldb, steps, c + n, ldc, 1, 4);
    for (; n < cols; n += 16) tile_product(a, lda, b + 2 * n, ldb, steps, c + n, ldc, 1, 1);
}

/* The task's tile configuration: tiles 0-7, 16 rows of 64 bytes each (release with _tile_release). */
static inline __attribute__((always_inline)) void tiles_begin(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Requests order[i0 .. i0 + n) (one prefix entry each, the same), KV head h. ws: decode_scratch floats. */
static inline __attribute__((always_inline)) void prefix_tile_task(
    const float *restrict q, int64_t q_stride, void *kt, void *v, const int64_t *rows, const int64_t *order,
    int64_t i0, int64_t n, const int64_t *lens, float *out, float *ws, int64_t H, int64_t h, int64_t Lcap,
    float scale, const uint16_t *pk, const uint16_t *pv, const int64_t *entry, const int64_t *plen, int64_t Pcap,
    int64_t window, const float *kn, int64_t kn_stride, const float *vn, int64_t vn_stride, const int64_t *new_pos,
    void *pool_k, void *pool_v, const int64_t *loc, const int64_t G, const int64_t D, const int KV) {
    const int64_t R = n * G, Rp = (R + 15) / 16 * 16, SS = Pcap + Lcap;
    int64_t P = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pl = plen[rows[order[i0 + i]]];
        P = pl > P ? pl : P;
    }
    const int64_t P16 = (P + 15) / 16 * 16, P32 = (P + 31) / 32 * 32;
    float *s = ws;                              /* Rp rows of SS: the prefix's scores, then the row's own */
    uint16_t *pb = (uint16_t *)(s + Rp * SS);    /* Rp x P32: the prefix's probabilities, bf16 */
    uint16_t *qb = pb + Rp * P32;                /* Rp x D: the queries, bf16 */
    float *ob = (float *)(qb + Rp * D);          /* Rp x D: the prefix's weighted V */
    const int64_t e = entry[rows[order[i0]]];
    float inv[TILE_CHUNK * GMAX]; /* 1 / each query row's softmax sum (tile_softmax) */
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = order[i0 + i], r = rows[b];
        if (kn)
            put(kn + b * kn_stride + h * D, vn + b * vn_stride + h * D, KV_AT(kt, (r * H + h) * D * Lcap, KV),
                KV_AT(v, (r * H + h) * Lcap * D, KV), new_pos[b],
                pool_k ? KV_AT(pool_k, (loc[b] * H + h) * D, KV) : NULL,
                pool_k ? KV_AT(pool_v, (loc[b] * H + h) * D, KV) : NULL, D, KV);
        to_bf16(q + b * q_stride + h * G * D, qb + i * G * D, G * D);
    }
    for (int64_t j = R * D; j < Rp * D; j++) qb[j] = 0;
    tiles_begin();
    const uint16_t *kp = pk + (e * H + h) * D * Pcap, *vp = pv + (e * H + h) * Pcap * D;
    for (int64_t m = 0; m < Rp; m += 32)
        tile_rows(qb + m * D, D, kp, 2 * Pcap, D / 32, s + m * SS, SS, Rp - m, P16);
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = order[i0 + i], r = rows[b], pl = plen[r];
        const int64_t lo = window > 0 && lens[r] > window ? lens[r] - window : 0;
        const int64_t poff = lo < pl ? lo : pl, off = lo > pl ? lo - pl : 0, own = lens[r] - pl - off;
        float *si = s + i * G * SS;
        /* the next request's own K^T on its way from memory meanwhile, as `head` does */
        const void *nk = i + 1 < n ? KV_AT(kt, (rows[order[i0 + i + 1]] * H + h) * D * Lcap, KV) : NULL;
        scores(q + b * q_stride + h * G * D, KV_AT(kt, (r * H + h) * D * Lcap, KV), off, own, Lcap, si + pl, SS,
               scale, G, D, nk, KV, 1);
        for (int64_t g = 0; g < G; g++)
            inv[i * G + g] = tile_softmax(si + g * SS, poff, pl, own, scale, pb + (i * G + g) * P32, P32);
    }
    for (int64_t j = R * P32; j < Rp * P32; j++) pb[j] = 0;
    for (int64_t m = 0; m < Rp; m += 32)
        tile_rows(pb + m * P32, P32, vp, 2 * D, P32 / 32, ob + m * D, D, Rp - m, D);
    _tile_release();
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = order[i0 + i], r = rows[b], pl = plen[r];
        const int64_t lo = window > 0 && lens[r] > window ? lens[r] - window : 0;
        const int64_t off = lo > pl ? lo - pl : 0, own = lens[r] - pl - off;
        float acc[GMAX][DMAX];
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) acc[g][d] = ob[(i * G + g) * D + d];
        const void *nv = i + 1 < n ? KV_AT(v, (rows[order[i0 + i + 1]] * H + h) * Lcap * D, KV) : NULL;
        weigh(acc, s + i * G * SS + pl, SS, KV_AT(v, (r * H + h) * Lcap * D, KV), off, own, G, D, nv, KV);
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) out[(b * H + h) * G * D + g * D + d] = acc[g][d] * inv[i * G + g];
    }
}

#define DECODE_TILES(GC, DC, KV)                                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                              \
    for (int64_t th = 0; th < ntasks * H; th++) {                                                      \
        const int64_t t = th / H;                                                                      \
        prefix_tile_task(q, q_stride, kt, v, rows, order, tstart[t], tlen[t], lens, out,               \
                         scratch + (int64_t)omp_get_thread_num() * per_thread, H, th % H, Lcap, scale,  \
                         pk, pv, entry, plen, Pcap, window, kn, kn_stride, vn, vn_stride, new_pos,     \
                         pool_k, pool_v, loc, (GC), (DC), KV);                                         \
    }
#define DECODE_TILES_BF16(GC, DC) DECODE_TILES(GC, DC, KV_BF16)
#define DECODE_TILES_E4M3(GC, DC) DECODE_TILES(GC, DC, KV_E4M3)
#define DECODE_TILES_E5M2(GC, DC) DECODE_TILES(GC, DC, KV_E5M2)
#else
int prefix_tiles_ready(void) { return 0; }
#endif

/* Floats of decode_attention_f32's scratch per thread for these shapes and `kv` (with its flag). */
int64_t decode_scratch(int64_t G, int64_t D, int64_t Pcap, int64_t Lcap, int kv) {
    if (!(kv & KV_TILES)) return G * (Pcap + Lcap);
    const int64_t Rp = (TILE_CHUNK * G + 15) / 16 * 16;
    return Rp * (Pcap + Lcap) + Rp * Pcap / 2 + Rp * D / 2 + Rp * D;
}

/* The tile tasks: the requests in order[n0 .. B) (sorted by prefix entry) in runs of one entry, each run cut
 * into chunks of at most `chunk` requests, as even as the run allows; returns how many. */
static int64_t tile_tasks(const int64_t *rows, const int64_t *order, const int64_t *entry, int64_t n0, int64_t B,
                          int64_t chunk, int64_t *tstart, int64_t *tlen) {
    int64_t nt = 0;
    for (int64_t i = n0; i < B;) {
        int64_t j = i + 1;
        while (j < B && entry[rows[order[j]]] == entry[rows[order[i]]]) j++;
        const int64_t k = (j - i + chunk - 1) / chunk; /* chunks of this run */
        for (int64_t c = 0; c < k; c++) {
            tstart[nt] = i + (j - i) * c / k;
            tlen[nt] = i + (j - i) * (c + 1) / k - tstart[nt];
            nt++;
        }
        i = j;
    }
    return nt;
}

int decode_attention_f32(const float *q, int64_t q_stride, void *kt, void *v, const int64_t *rows,
                         const int64_t *order, const int64_t *lens, float *out, float *scratch, int64_t B,
                         int64_t H, int64_t G, int64_t D, int64_t Lcap, float scale, int threads, const void *pk,
                         const void *pv, const int64_t *entry, const int64_t *plen, int64_t Pcap, int64_t window,
                         const float *kn, int64_t kn_stride, const float *vn, int64_t vn_stride,
                         const int64_t *new_pos, void *pool_k, void *pool_v, const int64_t *loc, int kv) {
    const int tiles = kv & KV_TILES;
    kv = KV_KIND(kv);
    if (G < 1 || G > GMAX || D < 1 || D > DMAX || threads < 1 || window < 0 || kv < KV_F32 || kv > KV_E5M2 ||
        Lcap % KT_BLOCK)
        return -1;
    if (!entry) Pcap = 0;
    if (tiles && entry && order) {
#ifdef TILES
        if (D % 32 || Pcap % 32 || PREFIX_KV(kv) != KV_BF16 || !prefix_tiles_ready()) return -1;
        /* The requests without a prefix come first in `order` and take the per-request path. */
        int64_t n0 = 0;
        while (n0 < B && plen[rows[order[n0]]] == 0) n0++;
        int64_t tstart[B > n0 ? B - n0 : 1], tlen[B > n0 ? B - n0 : 1];
        /* Smaller chunks while there are too few tasks to keep every thread busy. */
        int64_t chunk = TILE_CHUNK, ntasks = tile_tasks(rows, order, entry, n0, B, chunk, tstart, tlen);
        while (chunk > 4 && ntasks * H < 4 * threads)
            ntasks = tile_tasks(rows, order, entry, n0, B, chunk /= 2, tstart, tlen);
        const int64_t per_thread = decode_scratch(G, D, Pcap, Lcap, KV_TILES);
        const void *pk_ = pk, *pv_ = pv;
        {
            const uint16_t *pk = pk_, *pv = pv_;
            if (kv == KV_BF16) {
                DISPATCH(DECODE_TILES_BF16)
            } else if (kv == KV_E4M3) {
                DISPATCH(DECODE_TILES_E4M3)
            } else {
                DISPATCH(DECODE_TILES_E5M2)
            }
        }
        B = n0;
        if (B == 0) return 0;
#else
        return -1;
#endif
    }
    if (kv == KV_BF16) {
        DISPATCH(DECODE_BF16)
    } else if (kv == KV_E4M3) {
        DISPATCH(DECODE_E4M3)
    } else if (kv == KV_E5M2) {
        DISPATCH(DECODE_E5M2)
    } else {
        DISPATCH(DECODE_F32)
    }
    return 0;
}

/* out[0..D) = the fp8 row x[0..D) as float32 (16 at a time where the CPU has AVX-512; the scalar
 * fp8_value was a tenth of a prefill after a shared prefix). */
static inline __attribute__((always_inline)) void widen(const void *restrict x, float *restrict out, const int64_t D,
                                                         const int KV) {
    int64_t d = 0;
#ifdef X8
    const __m512 unit = _mm512_set1_ps(FP8_UNIT(KV));
    for (; d + 16 <= D; d += 16)
        _mm512_storeu_ps(out + d, _mm512_mul_ps(fp8x16(_mm_loadu_si128((const __m128i *)((const uint8_t *)x + d)), KV),
                                                unit));
#endif
    for (; d < D; d++) out[d] = ld(x, d, KV);
}

/* Request b's first n keys of KV head h, from the pool slots slots[0..n), into a K^T tile [D][Lcap] and a
 * V tile [Lcap][D] (the pool is token-major: [S, H, D]; the kernels want positions contiguous per d).
 * K^T is written GATHER_L positions (one cache line) at a time from GATHER_L slots held in L1.
 * SKV / DKV: what the pool / the tiles hold; the same kind is copied as it is (widening and rounding back
 * would give the same bits at twice the work). */
#define GATHER_L 16
static inline __attribute__((always_inline)) void gather(const void *restrict pool_k, const void *restrict pool_v,
                                                          const int64_t *restrict slots, int64_t n, int64_t h,
                                                          int64_t H, void *restrict kt, void *restrict vt,
                                                          int64_t Lcap, const int64_t D, const int SKV,
                                                          const int DKV, const int blk) {
    const int raw = SKV == DKV, size = KV_SIZE(SKV), fp8 = SKV == KV_E4M3 || SKV == KV_E5M2;
    float rows[GATHER_L][DMAX]; /* fp8 K: the block's rows widened first (a vector pass), then transposed */
    for (int64_t l0 = 0; l0 < n; l0 += GATHER_L) {
        const int64_t m = n - l0 < GATHER_L ? n - l0 : GATHER_L;
        if (fp8 && !raw) {
            for (int64_t i = 0; i < m; i++) widen(KV_AT(pool_k, (slots[l0 + i] * H + h) * D, SKV), rows[i], D, SKV);
            for (int64_t d = 0; d < D; d++)
                for (int64_t i = 0; i < m; i++)
                    st(kt, blk ? kt_at(d, l0 + i, D) : d * Lcap + l0 + i, rows[i][d], DKV);
        } else {
            for (int64_t d = 0; d < D; d++)
                for (int64_t i = 0; i < m; i++) {
                    const int64_t from = (slots[l0 + i] * H + h) * D + d;
                    const int64_t to = blk ? kt_at(d, l0 + i, D) : d * Lcap + l0 + i;
                    if (raw)
                        __builtin_memcpy(KV_AT(kt, to, DKV), KV_AT(pool_k, from, SKV), size);
                    else
                        st(kt, to, ld(pool_k, from, SKV), DKV);
                }
        }
        for (int64_t i = 0; i < m; i++) {
            const int64_t at = (slots[l0 + i] * H + h) * D;
            if (raw) {
                __builtin_memcpy(KV_AT(vt, (l0 + i) * D, DKV), KV_AT(pool_v, at, SKV), D * size);
            } else if (fp8 && DKV == KV_F32) {
                widen(KV_AT(pool_v, at, SKV), (float *)vt + (l0 + i) * D, D, SKV);
            } else {
#pragma omp simd
                for (int64_t d = 0; d < D; d++) st(vt, (l0 + i) * D + d, ld(pool_v, at + d, SKV), DKV);
            }
        }
    }
}

/* The dense decode rows' fill (decode_cache.py), one layer: J requests joining the decode batch, request
 * j's first start[j + 1] - start[j] keys, from the pool slots slots[start[j] ..), into dense row rows[j]
 * from position 0 (kt [Bcap, H] of D x Lcap blocked as kt_at, v [Bcap, H, Lcap, D]), by `gather`, one request
 * per task.
 * torch took an index_select and a permuted copy per (request, layer, K or V). */
void fill_rows_f32(const void *pool_k, const void *pool_v, const int64_t *slots, const int64_t *start,
                   const int64_t *rows, int64_t J, int64_t H, int64_t D, void *kt, void *v, int64_t Lcap,
                   int threads, int kv) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t j = 0; j < J; j++) {
        const int64_t r = rows[j];
        for (int64_t h = 0; h < H; h++) {
            void *kr = KV_AT(kt, (r * H + h) * D * Lcap, kv), *vr = KV_AT(v, (r * H + h) * Lcap * D, kv);
            const int64_t *sl = slots + start[j], n = start[j + 1] - start[j];
            if (kv == KV_BF16)
                gather(pool_k, pool_v, sl, n, h, H, kr, vr, Lcap, D, KV_BF16, KV_BF16, 1);
            else if (kv == KV_F32)
                gather(pool_k, pool_v, sl, n, h, H, kr, vr, Lcap, D, KV_F32, KV_F32, 1);
            else /* either fp8: a byte copy */
                gather(pool_k, pool_v, sl, n, h, H, kr, vr, Lcap, D, KV_E4M3, KV_E4M3, 1);
        }
    }
}

/* Dynamic schedule: requests differ in length, and a long one's pairs must not all land on one thread.
 * Each (request, KV head) gathers its keys into the thread's tiles once and keeps them in cache while
 * all its new tokens read them: XQ / G tokens at a time through `block` (compile-time QB), the rest
 * one by one. */
#define EXTEND_ROWS(GC, DC)                                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                             \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                           \
        const int64_t b = bh / H, h = bh % H, QB = (GC) >= XQ ? 1 : XQ / (GC), ostep = H * (GC) * (DC); \
        const int64_t n_new = q_start[b + 1] - q_start[b];                                             \
        if (n_new == 0) continue;                                                                      \
        float *s = scratch + (int64_t)omp_get_thread_num() * (((GC) > XQ ? (GC) : XQ) + 2 * (DC)) * Lcap; \
        float *kb = s + ((GC) > XQ ? (GC) : XQ) * Lcap, *vb = kb + (DC) * Lcap;                         \
        /* keys before the first new token's window are read by none: the tile starts at g0 */       \
        const int64_t g0 = window > 0 && prefix[b] + 1 > window ? prefix[b] + 1 - window : 0;          \
        const int64_t *sl = slots + b * Lcap + g0, nk = prefix[b] + n_new - g0;                       \
        if (kv == KV_BF16)                                                                             \
            gather(pool_k, pool_v, sl, nk, h, H, kb, vb, Lcap, (DC), KV_BF16, KV_F32, 0);              \
        else if (kv == KV_E4M3)                                                                        \
            gather(pool_k, pool_v, sl, nk, h, H, kb, vb, Lcap, (DC), KV_E4M3, KV_F32, 0);              \
        else if (kv == KV_E5M2)                                                                        \
            gather(pool_k, pool_v, sl, nk, h, H, kb, vb, Lcap, (DC), KV_E5M2, KV_F32, 0);              \
        else                                                                                           \
            gather(pool_k, pool_v, sl, nk, h, H, kb, vb, Lcap, (DC), KV_F32, KV_F32, 0);               \
        int64_t t = q_start[b];                                                                        \
        if (QB > 1)                                                                                    \
            for (; t + QB <= q_start[b + 1]; t += QB)                                                  \
                block(q + t * q_stride + h * (GC) * (DC), q_stride, kb, vb,                            \
                      prefix[b] + (t - q_start[b]) + 1 - g0, window, Lcap, out + (t * H + h) * (GC) * (DC), \
                      ostep, s, Lcap, scale, QB, (GC), (DC));                                          \
        for (; t < q_start[b + 1]; t++) {                                                              \
            const int64_t n = prefix[b] + (t - q_start[b]) + 1 - g0;                                   \
            const int64_t lo = window > 0 && n > window ? n - window : 0;                              \
            head(q + t * q_stride + h * (GC) * (DC), kb, vb, 0, 0, 0, kb, vb, lo, n - lo, Lcap,        \
                 out + (t * H + h) * (GC) * (DC), s, Lcap, scale, (GC), (DC), NULL, NULL, KV_F32, KV_F32, 0); \
        }                                                                                              \
    }

#ifdef TILES
/* The 16 x 16 32-bit words r[0..16) transposed in place (unpacks, then 128-bit lane shuffles). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* out[0..D) = the fp8 row x[0..D) as bf16: widened to float32 (`widen`, 16 at a time where the CPU has
 * AVX-512), then rounded (`to_bf16`), which every fp8 value survives exactly. One element at a time this
 * was a third of a prefill's attention over an fp8 pool. */
static inline __attribute__((always_inline)) void widen_bf16(const void *restrict x, uint16_t *restrict out,
                                                              const int64_t D, const int KV) {
    float row[DMAX];
    widen(x, row, D, KV);
    to_bf16(row, out, D);
}

/* Row `at` of a bf16 or fp8 pool as bf16: the pool's own row, or the fp8 one widened into buf[0..D). */
static inline __attribute__((always_inline)) const uint16_t *bf16_row(const void *pool, const int64_t at,
                                                                       uint16_t *buf, const int64_t D,
                                                                       const int KV) {
    if (KV == KV_BF16) return (const uint16_t *)KV_AT(pool, at, KV);
    widen_bf16(KV_AT(pool, at, KV), buf, D, KV);
    return buf;
}

/* 16 positions' bf16 K and V rows (kr[l], vr[l]: D elements each) into the tile layouts (extend_tile_task):
 * K^T pairs of dimensions, kt[j * L32 + l] (32-bit words), by 16 x 16 transposes; V pairs of positions,
 * vt[(l / 2) * 2 D + 2 d + l % 2], by interleaving two rows. A word or element at a time this was a tenth of
 * a prefill's attention after a shared prefix (each request gathers the prefix again). D a multiple of 32. */
static inline __attribute__((always_inline)) void tile_gather16(const uint16_t *const kr[16],
                                                                 const uint16_t *const vr[16], uint32_t *kt,
                                                                 int64_t L32, uint16_t *vt, const int64_t D) {
    const uint32_t *kw[16];
    for (int i = 0; i < 16; i++) kw[i] = (const uint32_t *)kr[i];
    for (int64_t j = 0; j < D / 2; j += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(kw[i] + j);
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (j + i) * L32, r[i]);
    }
    /* out[2 d] = a[d], out[2 d + 1] = b[d]: lanes 0-31 of the interleave of a and b's 32-element halves */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < 16; i += 2) {
        const uint16_t *a = vr[i], *b = vr[i + 1];
        uint16_t *out = vt + i * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
            _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

/* Prefill attention on tiles (`kv` | KV_TILES, a bf16 or fp8 pool): per (request, KV head, run of its query
 * rows [m_lo, m_hi), m_lo a multiple of 16) the keys those rows see go from the pool into the tile layout
 * (bf16, 16 positions at a time by tile_gather16; fp8 widens exactly), then 32 query rows at a time (token-
 * major, G heads a token) score every key up to the last row's own as tile products, take their causal (and
 * windowed) softmax as in `tile_softmax`, weight V as tile products and scale each row by 1 / its sum. q and
 * the probabilities are rounded to bf16 for the products, as on the decode side. Keys before the tile's first
 * row's window are skipped a multiple of 32 at a time. ws: extend_scratch floats. */
static inline __attribute__((always_inline)) void extend_tile_task(
    const float *restrict q, int64_t q_stride, const void *pool_k, const void *pool_v, const int64_t *slots,
    int64_t t0, int64_t n_new, int64_t pre, int64_t H, int64_t h, int64_t m_lo, int64_t m_hi, float *out, float *ws,
    int64_t Lcap, float scale, int64_t window, const int64_t G, const int64_t D, const int SKV) {
    const int64_t g0 = window > 0 && pre + 1 > window ? pre + 1 - window : 0; /* as EXTEND_ROWS */
    const int64_t R = m_hi < n_new * G ? m_hi : n_new * G; /* query rows [m_lo, R): tokens i = row / G */
    const int64_t nk = pre + (R - 1) / G + 1 - g0, L32 = (nk + 31) / 32 * 32;
    const int64_t Lp = (Lcap + 31) / 32 * 32, SS = Lp + 64;
    uint32_t *kt = (uint32_t *)ws;            /* [D/2][L32] bf16 pairs of dimensions */
    uint16_t *vt = (uint16_t *)(kt + D / 2 * Lp); /* [L32/2][D][2] bf16 pairs of positions */
    float *s = (float *)(vt + Lp * D);        /* 32 rows of SS */
    uint16_t *pb = (uint16_t *)(s + 32 * SS);  /* 32 rows of at most L32 */
    uint16_t *qb = pb + 32 * Lp;               /* 32 x D */
    float *ob = (float *)(qb + 32 * D);        /* 32 x D */
    int64_t l0 = 0;
    for (; l0 + 16 <= nk; l0 += 16) {
        const uint16_t *kr[16], *vr[16];
        uint16_t wide[2][16][DMAX]; /* fp8: the 16 positions' rows widened to bf16 first */
        for (int i = 0; i < 16; i++) {
            const int64_t at = (slots[g0 + l0 + i] * H + h) * D;
            kr[i] = bf16_row(pool_k, at, wide[0][i], D, SKV), vr[i] = bf16_row(pool_v, at, wide[1][i], D, SKV);
        }
        tile_gather16(kr, vr, kt + l0, L32, vt + l0 * D, D);
    }
    for (int64_t l = l0; l < L32; l++) {
        const int64_t at = l < nk ? (slots[g0 + l] * H + h) * D : -1;
        uint16_t *vr = vt + (l / 2) * 2 * D + (l & 1);
        if (at < 0) {
            for (int64_t j = 0; j < D / 2; j++) kt[j * L32 + l] = 0u;
            for (int64_t d = 0; d < D; d++) vr[2 * d] = 0;
        } else { /* bf16 rows (fp8 ones widened first): a pair of dimensions is one 32-bit word */
            uint16_t wide[2][DMAX] __attribute__((aligned(4)));
            const uint32_t *kw = (const uint32_t *)bf16_row(pool_k, at, wide[0], D, SKV);
            const uint16_t *vw = bf16_row(pool_v, at, wide[1], D, SKV);
            for (int64_t j = 0; j < D / 2; j++) kt[j * L32 + l] = kw[j];
            for (int64_t d = 0; d < D; d++) vr[2 * d] = vw[d];
        }
    }
    tiles_begin();
    for (int64_t m0 = m_lo; m0 < R; m0 += 32) {
        /* 32 rows at a time (two row blocks: tile_product), 16 for a last run of 16 or fewer */
        const int64_t mr = R - m0 < 32 ? R - m0 : 32, rows = mr > 16 ? 32 : 16;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = (m0 + r) / G, g = (m0 + r) % G;
            if (r < mr)
                to_bf16(q + (t0 + i) * q_stride + (h * G + g) * D, qb + r * D, D);
            else
                for (int64_t d = 0; d < D; d++) qb[r * D + d] = 0;
        }
        const int64_t n_first = pre + m0 / G + 1 - g0, n_last = pre + (m0 + mr - 1) / G + 1 - g0;
        const int64_t lo_first = window > 0 && n_first > window ? n_first - window : 0;
        const int64_t k0 = lo_first / 32 * 32, hi16 = (n_last + 15) / 16 * 16, W32 = (n_last - k0 + 31) / 32 * 32;
        tile_rows(qb, D, (const uint16_t *)kt + 2 * k0, 2 * L32, D / 32, s, SS, rows, hi16 - k0);
        float inv[32]; /* 1 / each row's softmax sum (tile_softmax) */
        for (int64_t r = 0; r < rows; r++) {
            uint16_t *pg = pb + r * W32;
            if (r >= mr) {
                for (int64_t j = 0; j < W32; j++) pg[j] = 0;
                continue;
            }
            const int64_t n = pre + (m0 + r) / G + 1 - g0, lo = window > 0 && n > window ? n - window : 0;
            inv[r] = tile_softmax(s + r * SS, lo - k0, n - k0, 0, scale, pg, W32);
        }
        tile_rows(pb, W32, vt + k0 * D, 2 * D, W32 / 32, ob, D, rows, D);
        for (int64_t r = 0; r < mr; r++) {
            const int64_t i = (m0 + r) / G, g = (m0 + r) % G;
            for (int64_t d = 0; d < D; d++) out[((t0 + i) * H + h) * G * D + g * D + d] = ob[r * D + d] * inv[r];
        }
    }
    _tile_release();
}

/* The first query row of run `part` of `parts` over R rows (part == parts: R), a multiple of 16: runs of
 * about equal causal work, row r costing about r, so run p starts near R sqrt(p / parts). */
static inline int64_t extend_cut(int64_t R, int64_t part, int64_t parts) {
    if (part >= parts) return R;
    const int64_t r = (int64_t)((double)R * sqrt((double)part / (double)parts)) / 16 * 16;
    return r < R ? r : R;
}

/* One task per (request, KV head, run of query rows): a few requests alone (a single long prompt) left
 * threads idle, so each request's rows are cut into `parts` runs (extend_cut), each task gathering the
 * keys its rows see. Tasks go heaviest first (every request's last run), so the dynamic schedule ends
 * evenly. */
#define EXTEND_TILES(GC, DC)                                                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                             \
    for (int64_t task = 0; task < B * H * parts; task++) {                                             \
        const int64_t part = parts - 1 - task / (B * H), bh = task % (B * H), b = bh / H;              \
        const int64_t n_new = q_start[b + 1] - q_start[b];                                             \
        const int64_t m_lo = extend_cut(n_new * (GC), part, parts);                                    \
        const int64_t m_hi = extend_cut(n_new * (GC), part + 1, parts);                                \
        if (m_lo >= m_hi) continue;                                                                    \
        float *ws = scratch + (int64_t)omp_get_thread_num() * per_thread;                              \
        if (kv == KV_BF16)                                                                             \
            extend_tile_task(q, q_stride, pool_k, pool_v, slots + b * Lcap, q_start[b], n_new, prefix[b], \
                             H, bh % H, m_lo, m_hi, out, ws, Lcap, scale, window, (GC), (DC), KV_BF16); \
        else if (kv == KV_E4M3)                                                                        \
            extend_tile_task(q, q_stride, pool_k, pool_v, slots + b * Lcap, q_start[b], n_new, prefix[b], \
                             H, bh % H, m_lo, m_hi, out, ws, Lcap, scale, window, (GC), (DC), KV_E4M3); \
        else                                                                                           \
            extend_tile_task(q, q_stride, pool_k, pool_v, slots + b * Lcap, q_start[b], n_new, prefix[b], \
                             H, bh % H, m_lo, m_hi, out, ws, Lcap, scale, window, (GC), (DC), KV_E5M2); \
    }
#endif

/* Floats of extend_attention_f32's scratch per thread for these shapes and `kv` (with its flag). */
int64_t extend_scratch(int64_t G, int64_t D, int64_t Lcap, int kv) {
    if (!(kv & KV_TILES)) return ((G > XQ ? G : XQ) + 2 * D) * Lcap;
    const int64_t Lp = (Lcap + 31) / 32 * 32;
    return D * Lp + 32 * (Lp + 64) + 16 * Lp + 48 * D;
}

int extend_attention_f32(const float *q, int64_t q_stride, const void *pool_k, const void *pool_v,
                         const int64_t *slots, const int64_t *q_start, const int64_t *prefix, float *out,
                         float *scratch, int64_t B, int64_t H, int64_t G, int64_t D, int64_t Lcap, float scale,
                         int threads, int64_t window, int kv) {
    const int tiles = kv & KV_TILES;
    kv = KV_KIND(kv);
    if (G < 1 || G > GMAX || D < 1 || D > DMAX || threads < 1 || window < 0 || kv < KV_F32 || kv > KV_E5M2)
        return -1;
    if (tiles) {
#ifdef TILES
        if (D % 32 || kv == KV_F32 || !prefix_tiles_ready()) return -1;
        const int64_t per_thread = extend_scratch(G, D, Lcap, KV_TILES);
        /* Runs per request: EXTEND_TASKS tasks a thread where the requests alone are fewer, no run shorter
         * than EXTEND_MIN_ROWS query rows (each run gathers its keys again). */
        int64_t active = 0, rows = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t n = q_start[b + 1] - q_start[b];
            active += n > 0;
            rows = n * G > rows ? n * G : rows;
        }
        int64_t parts = active ? (EXTEND_TASKS * threads + active * H - 1) / (active * H) : 1;
        if (parts > rows / EXTEND_MIN_ROWS) parts = rows / EXTEND_MIN_ROWS;
        if (parts < 1) parts = 1;
        DISPATCH(EXTEND_TILES)
        return 0;
#else
        return -1;
#endif
    }
    DISPATCH(EXTEND_ROWS)
    return 0;
}
