/* Greedy sampling's argmax over each row of the logits, as torch.argmax picks: the first maximum, or the
 * first NaN when a row has one. torch's CPU argmax compares one element at a time (~2.4 us per
 * 4,096-entry row); a vectorized max and then a search for its first index take a fraction of that.
 * NaN is tested on the bits: the library is built with -ffast-math, under which x != x is false.
 *   logits: [B, V] rows `stride` floats apart; out: [B] int64; threads: the forward's, over the rows */
#include <stdint.h>
#include <string.h>

/* Rows split over the threads from this many logits on; a parallel region costs a few microseconds. A
 * decode step of 64 rows over SmolLM2's 49,152-entry vocabulary (12.6 MB of logits), Xeon, median of 30:
 * 1.17 ms on one thread, 0.72 on two. */
#define PARALLEL_ELEMENTS (1 << 18)

static inline int is_nan(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

void argmax_rows_f32(const float *logits, int64_t stride, int64_t B, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (B * V >= PARALLEL_ELEMENTS)
    for (int64_t b = 0; b < B; b++) {
        const float *restrict x = logits + b * stride;
        float m = x[0];
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < V; i++) {
            m = x[i] > m ? x[i] : m;
            nan |= is_nan(x[i]);
        }
        int64_t at = 0;
        if (nan) {
            while (!is_nan(x[at])) at++;
        } else {
            while (x[at] != m) at++;
        }
        out[b] = at;
    }
}
