/* A decode step's decoder layers in one call: for a few rows (decodes of a lone request or a
 * handful), Python's per-op costs (module calls, argument checks, tensor allocations, one
 * ctypes call per op, about 10 microseconds each, ~300 a step) were a third of the step.
 *
 * It chains the very kernels the layer-by-layer path calls, in the same order on the same
 * values, so its output is bit-identical to that path: rms_norm, head_norms, silu_mul and
 * rotary from cpu_layer.c, linear_small and lora_add from cpu_linear.c (linear_int8 from
 * cpu_int8.c for int8 projections), reshape_and_cache and paged_decode from cpu_decode.c. They
 * come in as function pointers (`kernels`, in the order of `struct kernels`), since each
 * library is built with its own flags (cpu_layer.c without FMA contraction). The only work done
 * here is what the Python path did with torch between them: the query rows widened to a
 * contiguous float32 [T, H, D], and the attention's float32 output rounded to the model's
 * dtype (to nearest even, as torch rounds).
 *
 * Per layer l, with weights[l * 13 ...] = input norm, qkv weight, qkv bias (float32 or NULL),
 * o weight, post-attention norm, gate_up weight, down weight, then the four projections' int8
 * scales (NULL: the projection has weights of the model's dtype, else int8 ones with a float32
 * scale per `group` inputs, 0: per output channel, multiplied by linear_int8 of cpu_int8.c),
 * then the per-head q and k norms' weights (Qwen3's; NULL for models without them). With
 * `packed`, the bf16 projections are packed for the dot product (cpu_linear.c's
 * linear_packed_dot; linear_small takes them as its weight kind 2). With LoRA
 * adapters in the step (lora not NULL), lora[l * 4 ...] are the qkv, o, gate_up and down
 * projections' adapter tables (cpu_linear.c's struct lora_slots), and each projection's output
 * gets its rows' adapter products (lora_add, slot_of the rows' slots) as it is made:
 *
 *     h = rms_norm(x + residual)         (layer 0: rms_norm(residual), the embeddings)
 *     qkv = h @ Wqkv^T (+ b); each head of q, k normed (Qwen3); q, k rotated; k, v written to
 *     the layer's cache
 *     a = decode(q, cache) in float32, rounded to the dtype
 *     residual += a @ Wo^T; h = rms_norm(residual)
 *     x = silu_mul(h @ Wgu^T) @ Wdown^T
 *
 * residual ([T, hidden], the embeddings on entry) and x ([T, hidden]) are left for the final
 * norm. The KV cache of layer l is at kv + l * layer_bytes (keys) and + value_bytes (values).
 */
#include "cpu_common.h"

#include <stdlib.h>

typedef void (*rms_norm_fn)(const void *, void *, const void *, void *, int64_t, int64_t, float,
                            int, int);
typedef void (*linear_fn)(const void *, int, const void *, int, const float *, void *, int,
                          int64_t, int64_t, int64_t, int);
typedef void (*rotary_fn)(void *, int64_t, const void *, const void *, int64_t, int64_t,
                          int64_t, int, int);
typedef void (*silu_mul_fn)(const void *, void *, int64_t, int64_t, int, int);
typedef void (*cache_fn)(const char *, const char *, int64_t, int64_t, char *, char *,
                         const int64_t *, int64_t, int64_t);
typedef void (*linear_int8_fn)(const void *, int, const int8_t *, const float *, const float *,
                               void *, int, int64_t, int64_t, int64_t, int64_t, int, int);
typedef void (*head_norms_fn)(void *, int64_t, const void *, const void *, int64_t, int64_t,
                              int64_t, int64_t, float, int, int);
typedef void (*lora_fn)(const void *, void *, int, const void *, const int32_t *, int64_t,
                        int64_t, int64_t, int);
typedef void (*decode_fn)(const float *, const char *, const char *, int, const int32_t *,
                          int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float, float *, float *, const int32_t *, int64_t,
                          const float *, const float *, int);

struct kernels {
    rms_norm_fn rms_norm;
    linear_fn linear;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    cache_fn cache;
    decode_fn decode;
    linear_int8_fn linear_int8;
    head_norms_fn head_norms;
    lora_fn lora;
};

enum { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_QKV_SCALE,
       W_O_SCALE, W_GATE_UP_SCALE, W_DOWN_SCALE, W_Q_NORM, W_K_NORM, W_COUNT };

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_COUNT };

/* Layer l's adapter table for projection p, NULL without adapters in the step */
static inline const void *adapters(const void *const *lora, int64_t l, int p) {
    return lora ? lora[l * LORA_COUNT + p] : NULL;
}

/* y [rows, n] = x [rows, kdim] @ w[at]^T (+ bias), by the int8 kernel when w has its scales;
 * plus the rows' LoRA products when the step has adapters (lora: the projection's table) */
static void project(const struct kernels *k, const void *const *w, int at, int scale_at,
                    const float *bias, const void *lora, const int32_t *slot_of, const void *x,
                    void *y, int bf16, int packed, int64_t rows, int64_t n, int64_t kdim,
                    int64_t group, int num_threads) {
    if (w[scale_at])
        k->linear_int8(x, bf16, w[at], w[scale_at], bias, y, bf16, rows, n, kdim,
                       group ? group : kdim, 0, num_threads);
    else
        k->linear(x, bf16, w[at], bf16 ? 1 + packed : 0, bias, y, bf16, rows, n, kdim,
                  num_threads);
    if (lora)
        k->lora(x, y, bf16, lora, slot_of, rows, n, kdim, num_threads);
}

void decode_layers(const void *const *kernels, const void *const *weights, int64_t num_layers,
                   void *residual, void *x, int bf16, int64_t rows, int64_t hidden,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t intermediate, float eps, const void *cos, const void *sin,
                   char *kv, int64_t layer_bytes, int64_t value_bytes, const int64_t *slots,
                   const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                   int64_t block_size, float scale, int64_t group, int packed,
                   const void *const *lora, const int32_t *slot_of, int num_threads) {
    const struct kernels *k = (const struct kernels *)kernels;
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    /* scratch, in the model's dtype unless said */
    char *h = malloc((size_t)(rows * hidden * elem));
    char *qkv = malloc((size_t)(rows * qkv_width * elem));
    float *query = malloc((size_t)(rows * q_size) * sizeof(float));
    float *attn32 = malloc((size_t)(rows * q_size) * sizeof(float));
    float *lse = malloc((size_t)(rows * num_heads) * sizeof(float));
    char *attn = bf16 ? malloc((size_t)(rows * q_size * elem)) : (char *)attn32;
    char *o = malloc((size_t)(rows * hidden * elem));
    char *gate_up = malloc((size_t)(rows * 2 * intermediate * elem));
    char *act = malloc((size_t)(rows * intermediate * elem));
    for (int64_t l = 0; l < num_layers; l++) {
        const void *const *w = weights + l * W_COUNT;
        char *key_cache = kv + l * layer_bytes, *value_cache = key_cache + value_bytes;
        if (l == 0)
            k->rms_norm(residual, NULL, w[W_INPUT_NORM], h, rows, hidden, eps, bf16, num_threads);
        else
            k->rms_norm(x, residual, w[W_INPUT_NORM], h, rows, hidden, eps, bf16, num_threads);
        project(k, w, W_QKV, W_QKV_SCALE, w[W_QKV_BIAS], adapters(lora, l, LORA_QKV), slot_of,
                h, qkv, bf16, packed, rows, qkv_width, hidden, group, num_threads);
        if (w[W_Q_NORM]) /* Qwen3: each head of q and of k normed before the rotation */
            k->head_norms(qkv, qkv_width, w[W_Q_NORM], w[W_K_NORM], rows, num_heads,
                          num_kv_heads, head_dim, eps, bf16, num_threads);
        k->rotary(qkv, qkv_width, cos, sin, rows, num_heads + num_kv_heads, head_dim, bf16,
                  num_threads);
        k->cache(qkv + q_size * elem, qkv + (q_size + kv_size) * elem, qkv_width * elem,
                 qkv_width * elem, key_cache, value_cache, slots, rows, kv_size * elem);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t i = 0; i < q_size; i++)
                query[t * q_size + i] = bf16 ? bf16_to_f32(((const uint16_t *)qkv)[t * qkv_width + i])
                                              : ((const float *)qkv)[t * qkv_width + i];
        k->decode(query, key_cache, value_cache, bf16, tables, table_stride, seq_lens, rows,
                  num_heads, num_kv_heads, head_dim, block_size, scale, attn32, lse, NULL, 0,
                  NULL, NULL, num_threads);
        if (bf16)
            for (int64_t i = 0; i < rows * q_size; i++)
                ((uint16_t *)attn)[i] = f32_to_bf16(attn32[i]);
        project(k, w, W_O, W_O_SCALE, NULL, adapters(lora, l, LORA_O), slot_of, attn, o, bf16,
                packed, rows, hidden, q_size, group, num_threads);
        k->rms_norm(o, residual, w[W_POST_NORM], h, rows, hidden, eps, bf16, num_threads);
        project(k, w, W_GATE_UP, W_GATE_UP_SCALE, NULL, adapters(lora, l, LORA_GATE_UP), slot_of,
                h, gate_up, bf16, packed, rows, 2 * intermediate, hidden, group, num_threads);
        k->silu_mul(gate_up, act, rows, intermediate, bf16, num_threads);
        project(k, w, W_DOWN, W_DOWN_SCALE, NULL, adapters(lora, l, LORA_DOWN), slot_of, act, x,
                bf16, packed, rows, hidden, intermediate, group, num_threads);
    }
    free(h);
    free(qkv);
    free(query);
    free(attn32);
    free(lse);
    if (bf16)
        free(attn);
    free(o);
    free(gate_up);
    free(act);
}
