/* Paged decode attention for the CPU: one query token per sequence over its paged K/V.
 *
 * Built and loaded by kernels/native.py (gcc -O3 -march=native, cached per CPU).
 * Same maths as kernels/reference.py's decode, with float32 accumulation whatever the cache
 * dtype. Each sequence is one task (with fewer sequences than threads, a few tasks over runs of
 * its blocks, merged after): it walks its blocks in order, reads every K and V row
 * once straight from its block, and keeps its queries and accumulators in L1. The work is
 * written with GCC/Clang vector types of one register's width (16 floats with AVX-512, else
 * 8): a block's K and V rows of one KV head are widened to float32 once
 * (bf16 by a shift, fp16 by conversion; float32 rows are read in place), every query of the
 * group is dotted with every key of the block, and the softmax runs online one block at a
 * time with a vectorisable exp. Besides the output it returns the log-sum-exp of the scores.
 *
 * Cascade attention: a sequence whose first blocks are a prefix shared with others can start
 * from that prefix's attention, computed once for all of them elsewhere (its output and
 * log-sum-exp): the online softmax is seeded with it and the kernel reads only the
 * sequence's own blocks. That is the exact merge of the two softmaxes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* v folded to 8 lanes (the sum of its halves when it has 16). */
INLINE vf8 fold8(vf v) {
#if VL == 16
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return v;
#endif
}

/* Sum of the lanes, as a tree (a chain of scalar adds is four times longer). */
INLINE float hsum(vf v) {
    const vf8 a = fold8(v);
    const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                  __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The lane sums of four vectors, as the four lanes of one: halving folds, two vectors at a
 * time, so that every shuffle and add does useful work. */
INLINE vf4 hsum4(vf a, vf b, vf c, vf d) {
    const vf8 a8 = fold8(a), b8 = fold8(b), c8 = fold8(c), d8 = fold8(d);
    const vf8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 abcd = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(abcd, abcd, 0, 2, 4, 6) +
           __builtin_shufflevector(abcd, abcd, 1, 3, 5, 7);
}

/* One KV head's n rows of a block (stride bytes apart) as float32 rows of `width` floats:
 * the rows in place when they already are, else widened into `buf` (zero-padded). */
INLINE void rows_f32(const char *src, int64_t stride, int kv_dtype, int64_t n, int64_t dim,
                     int64_t width, int direct, float *buf, const float **rows) {
    for (int64_t t = 0; t < n; t++) {
        const char *row = src + t * stride;
        float *dst = buf + t * width;
        if (direct) {
            rows[t] = (const float *)row;
            continue;
        }
        rows[t] = dst;
        if (dim == width) { /* bf16 or fp16: float32 rows of whole vectors are direct */
            for (int64_t c = 0; c < width; c += VL) {
                const char *at = row + c * 2;
                const vf x = kv_dtype == KV_BFLOAT16 ? load_bf16(at) : load_f16(at);
                memcpy(dst + c, &x, sizeof x);
            }
            continue;
        }
        for (int64_t d = 0; d < dim; d++) {
            if (kv_dtype == KV_FLOAT32) {
                dst[d] = ((const float *)row)[d];
            } else if (kv_dtype == KV_BFLOAT16) {
                dst[d] = bf16_to_f32(((const uint16_t *)row)[d]);
            } else {
                dst[d] = (float)((const _Float16 *)row)[d];
            }
        }
        for (int64_t d = dim; d < width; d++) dst[d] = 0.0f;
    }
}

INLINE vf loadv(const float *p) { return *(const vf_u *)p; }
INLINE void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* One sequence's blocks [first_block, end_block). `width` is head_dim rounded up to whole
 * vectors; a compile-time constant in the specialised copies below, so that their loops unroll
 * and stay in registers. */
INLINE void decode_seq(const float *query, const char *key_cache, const char *value_cache,
                       int kv_dtype, const int32_t *table, int64_t seq_len, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const int64_t width,
                       int64_t block_size, float scale, int64_t first_block, int64_t end_block,
                       const float *seed_out, const float *seed_lse, float *out, float *lse) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t elem = kv_dtype == KV_FLOAT32 ? 4 : 2;
    const int64_t row_bytes = head_dim * elem;
    const int64_t token_bytes = num_kv_heads * row_bytes;
    const int64_t block_bytes = block_size * token_bytes;
    const int direct = kv_dtype == KV_FLOAT32 && head_dim == width;

    float q[num_heads][width], acc[num_heads][width];
    float kbuf[block_size][width], vbuf[block_size][width], p[group][block_size];
    float run_max[num_heads], run_sum[num_heads];
    const float *krows[block_size], *vrows[block_size];
    for (int64_t h = 0; h < num_heads; h++) {
        for (int64_t d = 0; d < width; d++) {
            q[h][d] = d < head_dim ? query[h * head_dim + d] * scale : 0.0f;
            /* seeded: as if the prefix's keys had been read, with total weight exp(lse) */
            acc[h][d] = seed_out && d < head_dim ? seed_out[h * head_dim + d] : 0.0f;
        }
        run_max[h] = seed_out ? seed_lse[h] : -INFINITY;
        run_sum[h] = seed_out ? 1.0f : 0.0f;
    }
    for (int64_t blk = first_block; blk < end_block; blk++) {
        const int64_t left = seq_len - blk * block_size;
        const int64_t n = left < block_size ? left : block_size;
        const int64_t block = (int64_t)table[blk] * block_bytes;
        /* The blocks are scattered over the pool, which defeats the hardware prefetcher: each
         * KV head asks for its rows of the next block into L2 as it starts on this block's.
         * On a 2-core Zen 4 EPYC, 32 rows of 256 tokens in blocks of 8 (32 heads, 8 KV heads,
         * D 64, bf16; bench/kernel_ab.py --kind attention) read K and V at 14.2 GB/s, against
         * 7.1 with the whole next block asked for into L1 at the block's start. Two blocks
         * ahead ran 0.96x of this; each head's rows into L1, 0.89x of the old way. */
        const int64_t next = blk + 1 < end_block ? (int64_t)table[blk + 1] * block_bytes : -1;
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            const char *keys = key_cache + block + kh * row_bytes;
            const char *values = value_cache + block + kh * row_bytes;
            for (int64_t t = 0; next >= 0 && t < block_size; t++)
                for (int64_t off = 0; off < row_bytes; off += 64) {
                    const int64_t at = next + t * token_bytes + kh * row_bytes + off;
                    __builtin_prefetch(key_cache + at, 0, 2);
                    __builtin_prefetch(value_cache + at, 0, 2);
                }
            rows_f32(keys, token_bytes, kv_dtype, n, head_dim, width, direct, &kbuf[0][0], krows);
            rows_f32(values, token_bytes, kv_dtype, n, head_dim, width, direct, &vbuf[0][0],
                     vrows);
            /* The group's heads go phase by phase (all scores, then all softmaxes, then all
             * P.V): within a head each phase waits on the one before, across heads they are
             * independent work for the core to overlap. */
            float tops[group];
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kh * group + g;
                /* scores */
                float top = run_max[h];
                int64_t t = 0;
                for (; t + 4 <= n; t += 4) { /* four keys at a time, reduced together */
                    vf d0 = loadv(&q[h][0]) * loadv(krows[t]);
                    vf d1 = loadv(&q[h][0]) * loadv(krows[t + 1]);
                    vf d2 = loadv(&q[h][0]) * loadv(krows[t + 2]);
                    vf d3 = loadv(&q[h][0]) * loadv(krows[t + 3]);
                    for (int64_t c = VL; c < width; c += VL) {
                        const vf qc = loadv(&q[h][c]);
                        d0 += qc * loadv(krows[t] + c);
                        d1 += qc * loadv(krows[t + 1] + c);
                        d2 += qc * loadv(krows[t + 2] + c);
                        d3 += qc * loadv(krows[t + 3] + c);
                    }
                    const vf4 s = hsum4(d0, d1, d2, d3);
                    for (int i = 0; i < 4; i++) {
                        p[g][t + i] = s[i];
                        top = s[i] > top ? s[i] : top;
                    }
                }
                for (; t < n; t++) {
                    vf dot = loadv(&q[h][0]) * loadv(krows[t]);
                    for (int64_t c = VL; c < width; c += VL)
                        dot += loadv(&q[h][c]) * loadv(krows[t] + c);
                    p[g][t] = hsum(dot);
                    top = p[g][t] > top ? p[g][t] : top;
                }
                tops[g] = top;
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kh * group + g;
                const float top = tops[g];
                /* online softmax: rescale what came before only when the max moved */
                float sum = run_sum[h];
                if (top != run_max[h]) {
                    const float alpha = exp_approx(run_max[h] - top); /* 0 on the first block */
                    sum *= alpha;
                    for (int64_t c = 0; c < width; c += VL)
                        storev(&acc[h][c], loadv(&acc[h][c]) * alpha);
                    run_max[h] = top;
                }
                for (int64_t t = 0; t < n; t++) {
                    p[g][t] = exp_approx(p[g][t] - top);
                    sum += p[g][t];
                }
                run_sum[h] = sum;
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kh * group + g;
                /* acc += p . V with the head's vectors in registers: one independent
                 * accumulator per vector of the head */
                vf a[width / VL];
                for (int64_t c = 0; c < width; c += VL) a[c / VL] = loadv(&acc[h][c]);
                for (int64_t t = 0; t < n; t++)
                    for (int64_t c = 0; c < width; c += VL)
                        a[c / VL] += p[g][t] * loadv(vrows[t] + c);
                for (int64_t c = 0; c < width; c += VL) storev(&acc[h][c], a[c / VL]);
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = run_sum[h] > 0.0f ? 1.0f / run_sum[h] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h][d] * inv;
        lse[h] = run_sum[h] > 0.0f ? run_max[h] + logf(run_sum[h]) : -INFINITY;
    }
}

/* Part `part` of `parts` of sequence b: its share of the blocks after the prefix it skips;
 * the first part starts from the prefix's attention when b has one. */
#define DECODE_PART(WIDTH, OUT, LSE) \
    decode_seq(query + b * num_heads * head_dim, key_cache, value_cache, kv_dtype, \
               tables + b * table_stride, seq_lens[b], num_heads, num_kv_heads, head_dim, \
               WIDTH, block_size, scale, first + (num_blocks - first) * part / parts, \
               first + (num_blocks - first) * (part + 1) / parts, \
               seeded && part == 0 ? prefix_out + seed * num_heads * head_dim : NULL, \
               seeded && part == 0 ? prefix_lse + seed * num_heads : NULL, OUT, LSE)

void paged_decode(const float *query,      /* [B, H, D] float32 */
                  const char *key_cache,   /* [N, bs, Hkv, D] of kv_dtype */
                  const char *value_cache, /* [N, bs, Hkv, D] of kv_dtype */
                  int kv_dtype,
                  const int32_t *tables,   /* [B, table_stride] */
                  int64_t table_stride,
                  const int32_t *seq_lens, /* [B] */
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, float scale,
                  float *out,              /* [B, H, D] float32 */
                  float *lse,              /* [B, H] float32 */
                  const int32_t *prefix_row, /* [B] or NULL: row of prefix_out seeding b, or -1 */
                  int64_t prefix_blocks,   /* leading blocks the seeded sequences skip */
                  const float *prefix_out, /* [R, H, D] float32 */
                  const float *prefix_lse, /* [R, H] float32 */
                  int num_threads) {
    const int64_t width = (head_dim + VL - 1) / VL * VL;
    /* Fewer sequences than threads (a lone request): each is cut into `parts` runs of blocks,
     * one task each, whose partial softmaxes are merged after (split-K). */
    const int64_t parts = num_seqs < num_threads ? (num_threads + num_seqs - 1) / num_seqs : 1;
    const int64_t heads_dim = num_heads * head_dim;
    float part_out[parts > 1 ? num_seqs * parts * heads_dim : 1];
    float part_lse[parts > 1 ? num_seqs * parts * num_heads : 1];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        const int64_t b = task / parts, part = task % parts;
        const int64_t seed = prefix_row ? prefix_row[b] : -1;
        const int seeded = seed >= 0;
        const int64_t first = seeded ? prefix_blocks : 0;
        const int64_t num_blocks = (seq_lens[b] + block_size - 1) / block_size;
        float *o = parts > 1 ? part_out + task * heads_dim : out + b * heads_dim;
        float *l = parts > 1 ? part_lse + task * num_heads : lse + b * num_heads;
        if (width == 64) DECODE_PART(64, o, l);
        else if (width == 128) DECODE_PART(128, o, l);
        else DECODE_PART(width, o, l);
    }
    if (parts == 1)
        return;
    for (int64_t b = 0; b < num_seqs; b++) { /* out = sum_k w_k out_k / sum_k w_k */
        for (int64_t h = 0; h < num_heads; h++) {
            float top = -INFINITY;
            for (int64_t k = 0; k < parts; k++) {
                const float l = part_lse[(b * parts + k) * num_heads + h];
                top = l > top ? l : top;
            }
            float weights[parts], total = 0.0f;
            for (int64_t k = 0; k < parts; k++) {
                const float l = part_lse[(b * parts + k) * num_heads + h];
                weights[k] = l == -INFINITY ? 0.0f : expf(l - top); /* a part with no block */
                total += weights[k];
            }
            float *dst = out + b * heads_dim + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < parts; k++)
                    sum += weights[k] * part_out[(b * parts + k) * heads_dim + h * head_dim + d];
                dst[d] = total > 0.0f ? sum / total : 0.0f;
            }
            lse[b * num_heads + h] = total > 0.0f ? top + logf(total) : -INFINITY;
        }
    }
}

/* Write each token's K and V rows (all KV heads, `row_bytes` each, rows `stride` bytes apart
 * in key/value) into its slot of the pool; slots < 0 are padding and skipped. */
void reshape_and_cache(const char *key, const char *value, int64_t key_stride,
                       int64_t value_stride, char *key_cache, char *value_cache,
                       const int64_t *slots, int64_t num_tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
    }
}
