/* Fused elementwise ops of a decoder layer for the CPU: residual add + RMSNorm, Qwen3's
 * per-head q/k RMSNorm in place, rotary embedding in place, SiLU(gate) * up.
 *
 * Built and loaded by kernels/native.py like cpu_decode.c, but with -ffp-contract=off: each
 * op rounds exactly where Hugging Face transformers' eager ops round (every product and sum
 * to the model dtype, RMSNorm in float32), so that greedy outputs stay token-identical to
 * it. What fusing saves is the passes over memory and the per-op dispatch: in bfloat16 each
 * torch op widens its inputs to float32 and rounds its output back, and a decoder layer runs
 * about fifteen of them outside the matmuls.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

enum { F32 = 0, BF16 = 1, F16 = 2 };
enum { PARTS = 16 }; /* partial sums of RMSNorm's sum of squares */

INLINE float load(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

INLINE void store(void *p, int64_t i, int dtype, float v) {
    if (dtype == F32) ((float *)p)[i] = v;
    else if (dtype == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((_Float16 *)p)[i] = (_Float16)v;
}

/* v rounded to the dtype, as float32: what a torch op in that dtype would have produced. */
INLINE float round_to(float v, int dtype) {
    if (dtype == F32) return v;
    if (dtype == BF16) return bf16_to_f32(f32_to_bf16(v));
    return (float)(_Float16)v;
}

/* Rows are spread over threads only when there is enough work to pay for waking them. The
 * dtype is switched on inside the loop, per row, so that each case inlines the row's code
 * with a constant dtype and its inner loops vectorise (OpenMP outlines the loop body before
 * constants propagate into it). */
#define PARALLEL_ROWS(rows, width) if ((rows) * (width) >= 32768) num_threads(num_threads)
#define BY_DTYPE(dtype, call)                                                                \
    switch (dtype) {                                                                         \
    case F32: call(F32); break;                                                              \
    case BF16: call(BF16); break;                                                            \
    default: call(F16);                                                                      \
    }

INLINE void rms_norm_row(const void *x, void *residual, const void *weight, void *out,
                         int64_t base, int64_t hidden, float eps, int dtype) {
    if (residual) {
        for (int64_t i = 0; i < hidden; i++)
            store(residual, base + i, dtype,
                  load(x, base + i, dtype) + load(residual, base + i, dtype));
    }
    const void *src = residual ? residual : x;
    /* sum of squares in PARTS independent partial sums, so that it vectorises (and adds in
     * the same order whatever the vector width) */
    float part[PARTS] = {0.0f};
    int64_t i = 0;
    for (; i + PARTS <= hidden; i += PARTS)
        for (int64_t j = 0; j < PARTS; j++) {
            const float v = load(src, base + i + j, dtype);
            part[j] += v * v;
        }
    float sum = 0.0f;
    for (; i < hidden; i++) sum += load(src, base + i, dtype) * load(src, base + i, dtype);
    for (int64_t j = 0; j < PARTS; j++) sum += part[j];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int64_t k = 0; k < hidden; k++) {
        const float normed = round_to(load(src, base + k, dtype) * inv, dtype);
        store(out, base + k, dtype, load(weight, k, dtype) * normed);
    }
}

/* out = weight * norm(x) per row; with `residual`, first residual = x + residual and out is
 * the norm of that sum (vLLM's fused_add_rms_norm). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t hidden, float eps, int dtype, int num_threads) {
#pragma omp parallel for PARALLEL_ROWS(rows, hidden)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(DT) rms_norm_row(x, residual, weight, out, r * hidden, hidden, eps, DT)
        BY_DTYPE(dtype, ROW)
#undef ROW
    }
}

/* Qwen3's per-head RMSNorm of q and k, in place: in each of the rows of x (`row_stride` elements
 * apart), the first num_heads heads of head_dim by q_weight, the next num_kv_heads by k_weight,
 * each head normalised as rms_norm normalises a row. */
void head_norms(void *x, int64_t row_stride, const void *q_weight, const void *k_weight,
                int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                float eps, int dtype, int num_threads) {
    const int64_t heads = num_heads + num_kv_heads;
#pragma omp parallel for PARALLEL_ROWS(rows * heads, head_dim)
    for (int64_t i = 0; i < rows * heads; i++) {
        const int64_t h = i % heads;
        const void *weight = h < num_heads ? q_weight : k_weight;
        const int64_t base = i / heads * row_stride + h * head_dim;
#define ROW(DT) rms_norm_row(x, NULL, weight, x, base, head_dim, eps, DT)
        BY_DTYPE(dtype, ROW)
#undef ROW
    }
}

INLINE void rotary_row(void *x, int64_t base, const void *cos, const void *sin, int64_t t,
                       int64_t heads, int64_t head_dim, int dtype) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++, base += head_dim) {
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load(x, base + i, dtype), x2 = load(x, base + half + i, dtype);
            const float c1 = load(cos, t + i, dtype), c2 = load(cos, t + half + i, dtype);
            const float s1 = load(sin, t + i, dtype), s2 = load(sin, t + half + i, dtype);
            /* x * cos + cat(-x2, x1) * sin, each product and the sum rounded */
            const float y1 = round_to(x1 * c1, dtype) + round_to(-x2 * s1, dtype);
            const float y2 = round_to(x2 * c2, dtype) + round_to(x1 * s2, dtype);
            store(x, base + i, dtype, y1);
            store(x, base + half + i, dtype, y2);
        }
    }
}

/* Rotate the first `heads` heads of each row of x in place (NeoX layout: halves rotate). */
void rotary(void *x, int64_t row_stride, const void *cos, const void *sin, int64_t rows,
            int64_t heads, int64_t head_dim, int dtype, int num_threads) {
#pragma omp parallel for PARALLEL_ROWS(rows, heads * head_dim)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(DT) rotary_row(x, r * row_stride, cos, sin, r * head_dim, heads, head_dim, DT)
        BY_DTYPE(dtype, ROW)
#undef ROW
    }
}

INLINE void silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t width, int dtype) {
    const int64_t in = r * 2 * width, o = r * width;
    for (int64_t i = 0; i < width; i++) {
        const float g = load(gate_up, in + i, dtype), u = load(gate_up, in + width + i, dtype);
        const float act = round_to(g / (1.0f + exp_approx(-g)), dtype);
        store(out, o + i, dtype, act * u);
    }
}

/* out = silu(gate) * up, gate and up the two halves of each row of gate_up. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype,
              int num_threads) {
#pragma omp parallel for PARALLEL_ROWS(rows, width)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(DT) silu_mul_row(gate_up, out, r, width, DT)
        BY_DTYPE(dtype, ROW)
#undef ROW
    }
}

typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* VL values from element i on, as float32, by whole-vector loads (not lane by lane). */
INLINE vf load_vec(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return *(const vf_u *)((const float *)p + i);
    if (dtype == BF16) return load_bf16((const uint16_t *)p + i);
    return load_f16((const _Float16 *)p + i);
}

/* Whether any lane of a comparison's result is set. */
INLINE int any_lane(vi hit) {
    uint64_t words[VL / 2];
    memcpy(words, &hit, sizeof hit);
    uint64_t found = 0;
    for (int64_t j = 0; j < VL / 2; j++) found |= words[j];
    return found != 0;
}

/* Lanes of a where mask is set, else of b. */
INLINE vf select(vi mask, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    const vi r = (ai & mask) | (bi & ~mask);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

INLINE int64_t argmax_row(const void *x, int64_t base, int64_t n, int dtype) {
    /* the max over vectors of VL partial maxima, then its first index; NaN counts as the
     * largest value, as in torch.argmax */
    vf part = (vf){0} - INFINITY;
    vi nan = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = load_vec(x, base + i, dtype);
        part = select(v > part, v, part);
        nan |= v != v;
    }
    float top = -INFINITY;
    int any_nan = 0;
    for (int64_t j = 0; j < VL; j++) {
        top = part[j] > top ? part[j] : top;
        any_nan |= nan[j];
    }
    for (; i < n; i++) {
        const float v = load(x, base + i, dtype);
        top = v > top ? v : top;
        any_nan |= v != v;
    }
    int64_t k = 0;
    for (; k + VL <= n; k += VL) { /* skip to the first vector holding it */
        const vf v = load_vec(x, base + k, dtype);
        if (any_lane(any_nan ? v != v : v == top)) break;
    }
    for (; k < n; k++) {
        const float v = load(x, base + k, dtype);
        if (any_nan ? v != v : v == top) return k;
    }
    return 0; /* every value -inf: torch answers 0 too */
}

/* The index of each row's largest value (the first, on ties): greedy sampling. */
void argmax_rows(const void *x, int64_t *out, int64_t rows, int64_t n, int dtype,
                 int num_threads) {
#pragma omp parallel for PARALLEL_ROWS(rows, n)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(DT) out[r] = argmax_row(x, r * n, n, DT)
        BY_DTYPE(dtype, ROW)
#undef ROW
    }
}

/* Grammar masks: in each listed row of float32 logits, set to -inf every token whose bit is
 * clear in that row's bitmask (32 tokens per int32 word, token t at bit t % 32 of word t / 32,
 * as xgrammar packs them). Words with every bit set are skipped: most of a constrained row's
 * vocabulary is either all allowed (inside a string) or all banned (structure). */
void mask_rows(float *logits, int64_t stride, const int32_t *bitmask, int64_t words,
               const int64_t *rows, int64_t num_rows, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows > 1)
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + i * words);
        for (int64_t w = 0; w < words; w++) {
            uint32_t allowed = mask[w];
            if (allowed == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t end = base + 32 < vocab ? base + 32 : vocab;
            for (int64_t t = base; t < end; t++) {
                if (!((allowed >> (t - base)) & 1u)) row[t] = -INFINITY;
            }
        }
    }
}
