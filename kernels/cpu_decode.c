/* Paged decode attention for the CPU: one query token per sequence over its paged K/V.
 *
 * Built and loaded by kernels/native.py (gcc -O3 -march=native -fopenmp, cached per CPU).
 * Same maths as kernels/reference.py's decode, with float32 accumulation whatever the cache
 * dtype. Each (sequence, KV head) is one task: it reads every K and V row of its head once,
 * straight from its block, and keeps the group's queries and accumulators in L1; the softmax
 * runs online one block at a time (one rescale per block, not per token). Besides the output
 * it returns the log-sum-exp of the scores, by which cascade attention merges partial results.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };

/* One head's row of the cache as float32: the row itself, or widened into `buf`. */
static inline const float *load_row(const char *src, int kv_dtype, int64_t n, float *buf) {
    if (kv_dtype == KV_FLOAT32) return (const float *)src;
    if (kv_dtype == KV_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)s[i] << 16;
            memcpy(&buf[i], &bits, sizeof(float));
        }
    } else {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; i++) buf[i] = (float)s[i];
    }
    return buf;
}

/* score[g][t] = q[g] . k[t] for the n (<= TILE) rows of a tile. Every query row is dotted
 * with TILE key rows at once: TILE independent accumulator chains instead of one. */
enum { TILE = 4 };

static inline void tile_scores(int64_t group, int64_t head_dim, int64_t stride,
                               const float (*q)[head_dim], const float *const k[TILE],
                               int64_t n, int64_t t0, float (*score)[stride]) {
    for (int64_t g = 0; g < group; g++) {
        if (n == TILE) {
            const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < head_dim; d++) {
                const float qd = q[g][d];
                s0 += qd * k0[d];
                s1 += qd * k1[d];
                s2 += qd * k2[d];
                s3 += qd * k3[d];
            }
            score[g][t0] = s0;
            score[g][t0 + 1] = s1;
            score[g][t0 + 2] = s2;
            score[g][t0 + 3] = s3;
        } else {
            for (int64_t t = 0; t < n; t++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; d++) s += q[g][d] * k[t][d];
                score[g][t0 + t] = s;
            }
        }
    }
}

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
                  int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t elem = kv_dtype == KV_FLOAT32 ? 4 : 2;
    const int64_t row_bytes = head_dim * elem;
    const int64_t token_bytes = num_kv_heads * row_bytes;
    const int64_t block_bytes = block_size * token_bytes;

    /* One task per sequence: it walks its blocks in order and reads each block whole (all
     * KV heads), which keeps the reads contiguous for the prefetcher. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t seq_len = seq_lens[b];
        float q[num_heads][head_dim], acc[num_heads][head_dim], buf[TILE][head_dim];
        float score[num_heads][block_size], run_max[num_heads], run_sum[num_heads];
        for (int64_t h = 0; h < num_heads; h++) {
            for (int64_t d = 0; d < head_dim; d++) {
                q[h][d] = query[(b * num_heads + h) * head_dim + d] * scale;
                acc[h][d] = 0.0f;
            }
            run_max[h] = -INFINITY;
            run_sum[h] = 0.0f;
        }
        const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const int64_t left = seq_len - blk * block_size;
            const int64_t n = left < block_size ? left : block_size;
            const int64_t block = (int64_t)tables[b * table_stride + blk] * block_bytes;
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                const int64_t h0 = kh * group;
                const char *keys = key_cache + block + kh * row_bytes;
                const char *values = value_cache + block + kh * row_bytes;
                for (int64_t t0 = 0; t0 < n; t0 += TILE) {
                    const int64_t m = n - t0 < TILE ? n - t0 : TILE;
                    const float *k[TILE];
                    for (int64_t i = 0; i < m; i++)
                        k[i] = load_row(keys + (t0 + i) * token_bytes, kv_dtype, head_dim, buf[i]);
                    tile_scores(group, head_dim, block_size, &q[h0], k, m, t0, &score[h0]);
                }
                for (int64_t h = h0; h < h0 + group; h++) {
                    float top = run_max[h];
                    for (int64_t t = 0; t < n; t++) top = score[h][t] > top ? score[h][t] : top;
                    const float alpha = expf(run_max[h] - top); /* 0 on the first block */
                    float sum = run_sum[h] * alpha;
                    for (int64_t t = 0; t < n; t++) {
                        score[h][t] = expf(score[h][t] - top);
                        sum += score[h][t];
                    }
                    for (int64_t d = 0; d < head_dim; d++) acc[h][d] *= alpha;
                    run_max[h] = top;
                    run_sum[h] = sum;
                }
                for (int64_t t = 0; t < n; t++) {
                    const float *v = load_row(values + t * token_bytes, kv_dtype, head_dim, buf[0]);
                    for (int64_t h = h0; h < h0 + group; h++) {
                        const float p = score[h][t];
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) acc[h][d] += p * v[d];
                    }
                }
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t row = b * num_heads + h;
            const float inv = run_sum[h] > 0.0f ? 1.0f / run_sum[h] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) out[row * head_dim + d] = acc[h][d] * inv;
            lse[row] = run_sum[h] > 0.0f ? run_max[h] + logf(run_sum[h]) : -INFINITY;
        }
    }
}
