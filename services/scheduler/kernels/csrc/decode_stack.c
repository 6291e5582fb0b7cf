/* A decode step of a Llama decoder stack, every layer in one call: the same kernels, with the
 * same arguments, in the same order as the Python layers (models/llama.py) call them through NativeKernels, so
 * the same bits, without the ~250 us of Python and torch per layer that a few-row step otherwise spends between
 * them (a third of a batch-1 step of a 30-layer model on 2 cores). model_executor/cpu_decode.py decides when it
 * runs: bf16 linears, the C decode attention, no bias, LoRA or per-head norms.
 *
 * Per layer l, rows T, hidden N, heads Hq = Hkv * G of D, intermediate I:
 *   h = norm_in(x += delta)            (layer 0: no add)
 *   qkv = h W_qkv^T                    [T, (Hq + 2 Hkv) D]: q, k, v heads side by side
 *   rotary on q and k                  (the first Hq + Hkv heads of each row, in place)
 *   a = attention(q; k, v stored)      [T, Hq D]: the new k, v written to the dense row and the pool first
 *   h = norm_post(x += a W_o^T)
 *   delta = silu_mul(h W_gu^T) W_down^T
 * x [T, N] is the residual stream (updated in place); delta [T, N] receives the last layer's MLP output (the
 * final norm adds it). layers [L][DS_COLS] int64: per layer the pointers below (0: NULL) and its window.
 * The attention arguments shared by the layers (rows .. loc, scale, caps) are the decode layout's, as in
 * decode_attention_f32. ws: a float32 workspace of decode_stack_workspace(...) floats.
 *
 * From the bf16 GEMM's threshold on, oneDNN's packed GEMM is faster than the native linear kernel, and only
 * torch calls it: `gemm` (not NULL) is then a callback into Python that runs layer l's linear `which` (DS_QKV,
 * DS_O, DS_GATE_UP or DS_DOWN) on its input in io and returns its output's address, which the caller keeps
 * alive until that linear's next call. The rest stays here, with bf16 where the Python layers hand bf16 over
 * (LlamaForCausalLM.use_bf16_edges): the norms write their linear's bf16 input (io[0]), o_proj, gate_up and
 * down return bf16, the gate writes down's bf16 input (io[2]); qkv returns float32, the attention writes
 * float32 (io[1]). Per layer that is four calls back into Python instead of about a dozen, and the delta of
 * the last layer is the last DS_DOWN output (`delta` is not written).
 * Where every linear has a copy in the AMX tile layout (linear.c's linear_tiles, up to TILES_MAX_T rows),
 * `gemm` NULL with `io` given: the stack calls that GEMM itself, the weight columns holding
 * the tile copies and io also the linears' outputs (qkv float32, o, gate_up and down bf16): the same kernel on
 * the same input as the callback's PackedLinear.forward, so the same bits, without four calls into Python a
 * layer; io[6], the last down output, is the last layer's MLP output.
 * Returns 0, or the first failing kernel's nonzero code (an unsupported head shape; out of memory; -2: a
 * callback failed).
 */
#include <stddef.h>
#include <stdint.h>

enum { DS_QKV, DS_O, DS_GATE_UP, DS_DOWN, DS_NORM_IN, DS_NORM_POST, DS_KT, DS_V, DS_PREFIX_K, DS_PREFIX_V,
       DS_POOL_K, DS_POOL_V, DS_WINDOW, DS_COLS };

int linear_bf16w_f32(const float *x, int64_t ldx, int64_t T, const uint16_t *w, int64_t N, int64_t K, float *out,
                     int threads);
int linear_tiles(const void *x, int64_t ldx, int x_bf16, int64_t T, const uint16_t *wp, int64_t N, int64_t K,
                 void *out, int out_bf16, int threads);
void add_rms_norm_f32(float *x, int64_t x_stride, const void *delta, int64_t delta_stride, void *out,
                      const float *w, int64_t T, int64_t N, float eps, int threads, int delta_bf16, int out_bf16);
void silu_mul_f32(const void *gate_up, void *out, int64_t T, int64_t I, int threads, int in_bf16, int out_bf16);
void rope_f32(float *x, const int64_t *positions, const float *cos_t, const float *sin_t, int64_t T,
              int64_t row_stride, int64_t heads, int64_t D, int64_t half, int threads);
int decode_attention_f32(const float *q, int64_t q_stride, void *kt, void *v, const int64_t *rows,
                         const int64_t *order, const int64_t *lens, float *out, float *scratch, int64_t B,
                         int64_t H, int64_t G, int64_t D, int64_t Lcap, float scale, int threads, const void *pk,
                         const void *pv, const int64_t *entry, const int64_t *plen, int64_t Pcap, int64_t window,
                         const float *kn, int64_t kn_stride, const float *vn, int64_t vn_stride,
                         const int64_t *new_pos, void *pool_k, void *pool_v, const int64_t *loc, int kv);
int64_t decode_scratch(int64_t G, int64_t D, int64_t Pcap, int64_t Lcap, int kv);

typedef const void *(*ds_gemm_fn)(int64_t layer, int64_t which);

/* The workspace's size in floats: h, qkv, the attention output, the o_proj output, gate_up, the gate's
 * output, and the attention kernel's scratch (threads * decode_scratch). */
int64_t decode_stack_workspace(int64_t T, int64_t N, int64_t Hkv, int64_t G, int64_t D, int64_t I, int64_t Lcap,
                               int64_t Pcap, int threads, int kv) {
    const int64_t Hq = Hkv * G;
    return T * (N + (Hq + 2 * Hkv) * D + Hq * D + N + 3 * I) + (int64_t)threads * decode_scratch(G, D, Pcap, Lcap, kv);
}

#define PTR(l, c) ((void *)(intptr_t)layers[(l) * DS_COLS + (c)])

/* A larger step's linears: the callback's (gemm), or the tile GEMM's (gemm NULL) into io's output buffers. */
typedef struct {
    ds_gemm_fn gemm;
    const int64_t *io, *layers;
    int64_t T;
    int threads;
    int *rc;
} larger_step;

/* Layer l's linear `which` on its input `in` (rows ld elements apart, bf16 or float32), N outputs of K
 * inputs; its output (float32 for qkv, else bf16), or NULL with *rc set. */
static const void *step_linear(const larger_step *st, int64_t l, int64_t which, const void *in, int64_t ld,
                               int in_bf16, int64_t N, int64_t K) {
    if (st->gemm) {
        const void *y = st->gemm(l, which);
        if (!y) *st->rc = -2;
        return y;
    }
    void *out = (void *)(intptr_t)st->io[3 + which];
    const int64_t *layers = st->layers;
    *st->rc = linear_tiles(in, ld, in_bf16, st->T, PTR(l, which), N, K, out, which != DS_QKV, st->threads);
    return *st->rc ? NULL : out;
}

int decode_stack_f32(float *x, float *delta, int64_t T, const int64_t *layers, int64_t L, int64_t N, int64_t Hkv,
                     int64_t G, int64_t D, int64_t I, float eps, const int64_t *positions, const float *cos_t,
                     const float *sin_t, int64_t half, const int64_t *rows, const int64_t *order,
                     const int64_t *lens, int64_t Lcap, float scale, const int64_t *entry, const int64_t *plen,
                     int64_t Pcap, const int64_t *new_pos, const int64_t *loc, int kv, float *ws,
                     int threads, ds_gemm_fn gemm, const int64_t *io) {
    const int64_t Hq = Hkv * G, Q = (Hq + 2 * Hkv) * D;
    float *h = ws, *qkv = h + T * N, *att = qkv + T * Q, *o = att + T * Hq * D, *gu = o + T * N;
    float *act = gu + T * 2 * I, *scratch = act + T * I;
    int rc = 0;
    if (io) { /* the larger steps: the callback's linears (gemm), else the tile GEMM's */
        void *hb = (void *)(intptr_t)io[0], *actb = (void *)(intptr_t)io[2];
        float *a = (float *)(intptr_t)io[1];
        const void *d = NULL; /* the previous layer's down output, bf16 */
        scratch = ws;         /* the workspace is the attention's scratch only (decode_stack_workspace at T = 0) */
        const larger_step st = {gemm, io, layers, T, threads, &rc};
        for (int64_t l = 0; l < L && rc == 0; l++) {
            add_rms_norm_f32(x, N, d, d ? N : 0, hb, PTR(l, DS_NORM_IN), T, N, eps, threads, 1, 1);
            float *q = (float *)step_linear(&st, l, DS_QKV, hb, N, 1, Q, N);
            if (!q) break;
            rope_f32(q, positions, cos_t, sin_t, T, Q, Hq + Hkv, D, half, threads);
            if ((rc = decode_attention_f32(q, Q, PTR(l, DS_KT), PTR(l, DS_V), rows, order, lens, a, scratch, T, Hkv,
                                           G, D, Lcap, scale, threads, PTR(l, DS_PREFIX_K), PTR(l, DS_PREFIX_V),
                                           entry, plen, Pcap, layers[l * DS_COLS + DS_WINDOW], q + Hq * D, Q,
                                           q + (Hq + Hkv) * D, Q, new_pos, PTR(l, DS_POOL_K), PTR(l, DS_POOL_V),
                                           loc, kv)))
                break;
            const void *ob = step_linear(&st, l, DS_O, a, Hq * D, 0, N, Hq * D);
            if (!ob) break;
            add_rms_norm_f32(x, N, ob, N, hb, PTR(l, DS_NORM_POST), T, N, eps, threads, 1, 1);
            const void *gub = step_linear(&st, l, DS_GATE_UP, hb, N, 1, 2 * I, N);
            if (!gub) break;
            silu_mul_f32(gub, actb, T, I, threads, 1, 1);
            d = step_linear(&st, l, DS_DOWN, actb, I, 1, N, I);
        }
        return rc;
    }
    for (int64_t l = 0; l < L && rc == 0; l++) {
        add_rms_norm_f32(x, N, l ? delta : NULL, l ? N : 0, h, PTR(l, DS_NORM_IN), T, N, eps, threads, 0, 0);
        if ((rc = linear_bf16w_f32(h, N, T, PTR(l, DS_QKV), Q, N, qkv, threads))) break;
        rope_f32(qkv, positions, cos_t, sin_t, T, Q, Hq + Hkv, D, half, threads);
        /* entry NULL: no shared prefixes, and the prefix columns are 0 */
        if ((rc = decode_attention_f32(qkv, Q, PTR(l, DS_KT), PTR(l, DS_V), rows, order, lens, att, scratch, T, Hkv,
                                       G, D, Lcap, scale, threads, PTR(l, DS_PREFIX_K), PTR(l, DS_PREFIX_V), entry,
                                       plen, Pcap, layers[l * DS_COLS + DS_WINDOW], qkv + Hq * D, Q,
                                       qkv + (Hq + Hkv) * D, Q, new_pos, PTR(l, DS_POOL_K), PTR(l, DS_POOL_V), loc,
                                       kv)))
            break;
        if ((rc = linear_bf16w_f32(att, Hq * D, T, PTR(l, DS_O), N, Hq * D, o, threads))) break;
        add_rms_norm_f32(x, N, o, N, h, PTR(l, DS_NORM_POST), T, N, eps, threads, 0, 0);
        if ((rc = linear_bf16w_f32(h, N, T, PTR(l, DS_GATE_UP), 2 * I, N, gu, threads))) break;
        silu_mul_f32(gu, act, T, I, threads, 0, 0);
        rc = linear_bf16w_f32(act, I, T, PTR(l, DS_DOWN), N, I, delta, threads);
    }
    return rc;
}
