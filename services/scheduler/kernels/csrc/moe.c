/* The expert matmuls of an MoE layer at decode sizes (CPU float32): out[r] = a[r] W[e]^T for the few
 * rows r routed to each expert e. MKL's sgemm takes a slow path on this machine's AMD CPUs for GEMMs of
 * 2-16 rows (several times the time of reading the weights once), and oneDNN's call overhead is as
 * large; here each weight row is read once and dotted with every row of its expert while it is in L1,
 * so the step costs what reading the routed experts' weights costs.
 *   a:      rows of K floats, row r at a + r * lda
 *   w:      [E, N, K] contiguous (one [N, K] matrix per expert)
 *   groups: [G, 3] int64 (expert, first row, number of rows): row ranges of a, each one expert's
 *   out:    [rows, N] contiguous; only the groups' rows are written
 * Work is split over (group, block of NB output columns), so batch 1 (k experts) and batch 64 (most
 * experts) both keep every thread busy. */
#include <omp.h>
#include <stdint.h>

#define NB 64

static inline float dot_f32(const float *restrict x, const float *restrict y, int64_t K) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += x[k] * y[k];
    return s;
}

void moe_gemm_f32(const float *a, int64_t lda, const float *w, int64_t N, int64_t K, const int64_t *groups,
                  int64_t G, float *out, int threads) {
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t e = groups[3 * g], r0 = groups[3 * g + 1], m = groups[3 * g + 2];
            const int64_t n1 = (b + 1) * NB < N ? (b + 1) * NB : N;
            for (int64_t n = b * NB; n < n1; n++) {
                const float *restrict wr = w + (e * N + n) * K;
                for (int64_t r = r0; r < r0 + m; r++) out[r * N + n] = dot_f32(a + r * lda, wr, K);
            }
        }
    }
}
