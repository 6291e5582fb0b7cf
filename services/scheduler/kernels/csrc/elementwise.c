/* Elementwise steps of a Llama layer fused into one pass each (CPU float32). torch runs each as several
 * memory-bound passes with temporaries (rotary: 4 mul + add + sub + cat; the MLP gate: silu over a
 * strided half, then mul), which cost about as much as the layer's GEMMs in a prefill step. Large
 * calls split rows over `threads` OpenMP threads; small ones (decode) stay on the calling thread.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define PARALLEL_ROWS 64

/* Rotary embedding, HF "rotate half" layout, in place on the first `heads` heads of each row:
 *   x:   row t starts at x + t * row_stride; heads of D floats follow each other
 *   cos, sin: [max_position, half] tables, indexed by positions[t]
 * For each head: (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin) over the first 2 * half dims. */
void rope_f32(float *x, const int64_t *positions, const float *cos_t, const float *sin_t, int64_t T,
              int64_t row_stride, int64_t heads, int64_t D, int64_t half, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cos_t + positions[t] * half;
        const float *restrict s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *restrict x1 = x + t * row_stride + h * D;
            float *restrict x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i];  gate_up: [T, 2 I], out: [T, I]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = gate_up + t * 2 * I;
        const float *restrict u = g + I;
        float *restrict o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* The residual add and the RMSNorm after it (Llama's norms take the sum of a layer's input and its
 * attention or MLP output): x += delta (delta NULL: no add), then out = w * (x / sqrt(mean(x^2) + eps)),
 * in the order HF's LlamaRMSNorm multiplies. x: [T, N] rows x_stride floats apart, updated in place;
 * delta: [T, N] rows delta_stride apart; out: [T, N] contiguous. The scale is computed in double. */
void add_rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, float *out,
                      const float *w, int64_t T, int64_t N, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *restrict xr = x + t * x_stride;
        float *restrict o = out + t * N;
        if (delta) {
            const float *restrict dr = delta + t * delta_stride;
#pragma omp simd
            for (int64_t i = 0; i < N; i++) xr[i] += dr[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; i++) ss += xr[i] * xr[i];
        const float r = (float)(1.0 / sqrt((double)ss / (double)N + (double)eps));
#pragma omp simd
        for (int64_t i = 0; i < N; i++) o[i] = w[i] * (xr[i] * r);
    }
}
