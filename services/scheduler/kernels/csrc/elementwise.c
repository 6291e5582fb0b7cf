/* Elementwise steps of a Llama layer fused into one pass each (CPU float32 arithmetic). torch runs each
 * as several memory-bound passes with temporaries (rotary: 4 mul + add + sub + cat; the MLP gate: silu
 * over a strided half, then mul), which cost about as much as the layer's GEMMs in a prefill step. Large
 * calls split rows over `threads` OpenMP threads; small ones (decode) stay on the calling thread.
 *
 * With bf16 linears the SiLU gate and the norm read a GEMM's bf16 output and write the next GEMM's
 * bf16 input themselves (the *_bf16 flags), rounding as torch's .to(torch.bfloat16) does, so the
 * results are the same bits as converting around each GEMM, without the two extra passes and
 * temporaries per linear.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define PARALLEL_ROWS 64

typedef union {
    float f;
    uint32_t u;
} bits32;

static inline float bf16_to_f32(uint16_t h) {
    bits32 b = {.u = (uint32_t)h << 16};
    return b.f;
}

/* Round to nearest even, NaN to the quiet NaN 0x7FC0: c10::BFloat16's rounding. */
static inline uint16_t f32_to_bf16(float f) {
    bits32 b = {.f = f};
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

/* Element i of a row that holds float32 (bf == 0) or bf16 (bf == 1); bf is a constant where called. */
static inline float load_at(const void *row, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void store_at(void *row, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)row)[i] = f32_to_bf16(v);
    else
        ((float *)row)[i] = v;
}

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

#define SILU_CHUNK 64

static inline float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* One row: whole 64-element chunks straight from memory, a short tail through zero-padded aligned
 * buffers, so that every element goes through the same vectorized expf whatever the dtypes (the
 * compiler's scalar epilogue would differ from it by an ulp): a bf16 result is then exactly the
 * rounded float32 one. */
static inline void silu_mul_row(const void *restrict gate_up, void *restrict out, int64_t t, int64_t I,
                                int in_bf, int out_bf) {
    const char *g = (const char *)gate_up + t * 2 * I * (in_bf ? 2 : 4);
    const char *u = g + I * (in_bf ? 2 : 4);
    char *o = (char *)out + t * I * (out_bf ? 2 : 4);
    const int64_t whole = I - I % SILU_CHUNK;
    for (int64_t c = 0; c < whole; c += SILU_CHUNK) {
#pragma omp simd
        for (int64_t i = c; i < c + SILU_CHUNK; i++)
            store_at(o, i, silu_times(load_at(g, i, in_bf), load_at(u, i, in_bf)), out_bf);
    }
    if (whole < I) {
        float gb[SILU_CHUNK] __attribute__((aligned(64)));
        float ub[SILU_CHUNK] __attribute__((aligned(64)));
        for (int64_t i = 0; i < SILU_CHUNK; i++) {
            gb[i] = whole + i < I ? load_at(g, whole + i, in_bf) : 0.0f;
            ub[i] = whole + i < I ? load_at(u, whole + i, in_bf) : 0.0f;
        }
#pragma omp simd aligned(gb, ub : 64)
        for (int64_t i = 0; i < SILU_CHUNK; i++) gb[i] = silu_times(gb[i], ub[i]);
        for (int64_t i = whole; i < I; i++) store_at(o, i, gb[i - whole], out_bf);
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i];  gate_up: [T, 2 I], out: [T, I], each float32
 * or (in_bf16, out_bf16) bf16. */
void silu_mul_f32(const void *gate_up, void *out, int64_t T, int64_t I, int threads, int in_bf16, int out_bf16) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        if (in_bf16 && out_bf16)
            silu_mul_row(gate_up, out, t, I, 1, 1);
        else if (in_bf16)
            silu_mul_row(gate_up, out, t, I, 1, 0);
        else if (out_bf16)
            silu_mul_row(gate_up, out, t, I, 0, 1);
        else
            silu_mul_row(gate_up, out, t, I, 0, 0);
    }
}

static inline void add_row(float *restrict xr, const void *restrict dr, int64_t N, int bf) {
#pragma omp simd
    for (int64_t i = 0; i < N; i++) xr[i] += load_at(dr, i, bf);
}

static inline void scale_row(const float *restrict xr, const float *restrict w, float r, void *restrict o,
                             int64_t N, int bf) {
#pragma omp simd
    for (int64_t i = 0; i < N; i++) store_at(o, i, w[i] * (xr[i] * r), bf);
}

/* The residual add and the RMSNorm after it (Llama's norms take the sum of a layer's input and its
 * attention or MLP output): x += delta (delta NULL: no add), then out = w * (x / sqrt(mean(x^2) + eps)),
 * in the order HF's LlamaRMSNorm multiplies. x: [T, N] float32 rows x_stride elements apart, updated in
 * place; delta: [T, N] rows delta_stride elements apart, float32 or (delta_bf16) bf16; out: [T, N]
 * contiguous, float32 or (out_bf16) bf16. The scale is computed in double. */
void add_rms_norm_f32(float *x, int64_t x_stride, const void *delta, int64_t delta_stride, void *out,
                      const float *w, int64_t T, int64_t N, float eps, int threads, int delta_bf16, int out_bf16) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *restrict xr = x + t * x_stride;
        if (delta) {
            const char *dr = (const char *)delta + t * delta_stride * (delta_bf16 ? 2 : 4);
            if (delta_bf16)
                add_row(xr, dr, N, 1);
            else
                add_row(xr, dr, N, 0);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; i++) ss += xr[i] * xr[i];
        const float r = (float)(1.0 / sqrt((double)ss / (double)N + (double)eps));
        char *o = (char *)out + t * N * (out_bf16 ? 2 : 4);
        if (out_bf16)
            scale_row(xr, w, r, o, N, 1);
        else
            scale_row(xr, w, r, o, N, 0);
    }
}
