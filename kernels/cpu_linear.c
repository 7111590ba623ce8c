/* Linear layers over a few rows: y[m, :] = x[m, :] @ w^T (+ bias), float32 accumulation.
 *
 * A decode step multiplies a few rows by every weight matrix, so it is bound by reading the
 * weights: each thread reads a contiguous run of output rows (one stream for the prefetcher),
 * ROWS at a time, and takes every x row through them while they are in L1, so the weights
 * cross the memory bus once per step. bf16 weights are widened to float32 as they are read
 * (a shift, exact): a bf16 model reads half the bytes on CPUs without bf16 arithmetic, where
 * torch's bf16 matmul is far slower than this.
 *
 * x: [M, K] float32, contiguous; w: [N, K] float32 or bf16, contiguous; bias: [N] float32 or
 * NULL; y: [M, N] float32.
 */
#include "cpu_common.h"

#define ROWS 4  /* weight rows per tile */
#define XROWS 2 /* x rows per tile: XROWS * ROWS accumulators, ROWS weight vectors in registers */

INLINE vf load_w(const void *w, int64_t i, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : *(const vf_u *)((const float *)w + i);
}

INLINE float w_at(const void *w, int64_t i, const int bf16) {
    if (!bf16)
        return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++)
        s += v[i];
    return s;
}

/* Rows n0 .. n0 + R of y for x rows m0 .. m0 + P: each weight vector is loaded (and widened)
 * once for the P rows. R, P and bf16 are constants where this is inlined. */
INLINE void tile(const float *x, const void *w, const float *bias, float *y, int64_t N,
                 int64_t K, int64_t m0, int64_t n0, const int P, const int R, const int bf16) {
    const int64_t kv = K - K % VL;
    vf acc[XROWS][ROWS];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            acc[p][r] = (vf){0};
    for (int64_t k = 0; k < kv; k += VL) {
        vf wv[ROWS];
        for (int r = 0; r < R; r++)
            wv[r] = load_w(w, (n0 + r) * K + k, bf16);
        for (int p = 0; p < P; p++) {
            const vf xv = *(const vf_u *)(x + (m0 + p) * K + k);
            for (int r = 0; r < R; r++)
                acc[p][r] += xv * wv[r];
        }
    }
    for (int p = 0; p < P; p++) {
        const float *xm = x + (m0 + p) * K;
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[p][r]);
            for (int64_t k = kv; k < K; k++)
                s += xm[k] * w_at(w, (n0 + r) * K + k, bf16);
            y[(m0 + p) * N + n0 + r] = bias ? s + bias[n0 + r] : s;
        }
    }
}

/* Rows n0 .. n0 + R of y for every x row: XROWS x rows at a time while the R weight rows are
 * in L1 (after the first tile they come from there, not from memory). */
INLINE void rows_block(const float *x, const void *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t n0, const int R, const int bf16) {
    int64_t m = 0;
    for (; m + XROWS <= M; m += XROWS)
        tile(x, w, bias, y, N, K, m, n0, XROWS, R, bf16);
    for (; m < M; m++)
        tile(x, w, bias, y, N, K, m, n0, 1, R, bf16);
}

INLINE void linear_rows(const float *x, const void *w, const float *bias, float *y, int64_t M,
                        int64_t N, int64_t K, const int bf16, int num_threads) {
    const int64_t full = N / ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < full; b++)
        rows_block(x, w, bias, y, M, N, K, b * ROWS, ROWS, bf16);
    for (int64_t n = full * ROWS; n < N; n++) /* the last N % ROWS rows */
        rows_block(x, w, bias, y, M, N, K, n, 1, bf16);
}

void linear_small(const float *x, const void *w, int w_bf16, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int num_threads) {
    if (w_bf16)
        linear_rows(x, w, bias, y, M, N, K, 1, num_threads);
    else
        linear_rows(x, w, bias, y, M, N, K, 0, num_threads);
}
