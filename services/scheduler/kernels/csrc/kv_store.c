/* A decode step's new K/V, written where the next steps read them, in one pass per layer: the KV pool
 * (token-indexed: slot loc[b]) and the dense decode rows (row rows[b], position pos[b]; K transposed).
 * torch needs an index_copy_ per pool buffer and an advanced-index put per dense buffer for this (four
 * calls, ~100 us a layer at 64 requests); the bytes moved are a few KiB.
 *   k, v: [B, H, D], request b's at k + b * k_stride (views into the fused qkv output)
 *   pool_k, pool_v: [S, H, D] (NULL: not written); dkt: [Bcap, H, D, Lcap]; dv: [Bcap, H, Lcap, D]
 * Indices are int64 and checked by the caller. */
#include <stdint.h>
#include <string.h>

void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t B, int64_t H,
                  int64_t D, float *pool_k, float *pool_v, const int64_t *loc, float *dkt, float *dv,
                  const int64_t *rows, const int64_t *pos, int64_t Lcap) {
    const int64_t hd = H * D;
    for (int64_t b = 0; b < B; b++) {
        const float *restrict kb = k + b * k_stride;
        const float *restrict vb = v + b * v_stride;
        if (pool_k) {
            memcpy(pool_k + loc[b] * hd, kb, hd * sizeof(float));
            memcpy(pool_v + loc[b] * hd, vb, hd * sizeof(float));
        }
        const int64_t r = rows[b], p = pos[b];
        for (int64_t h = 0; h < H; h++) {
            float *restrict kt = dkt + (r * H + h) * D * Lcap + p;
            for (int64_t d = 0; d < D; d++) kt[d * Lcap] = kb[h * D + d];
            memcpy(dv + ((r * H + h) * Lcap + p) * D, vb + h * D, D * sizeof(float));
        }
    }
}
