/* Linear layers over a few rows: y[m, :] = x[m, :] @ w^T (+ bias), float32 accumulation (any
 * number of rows in the batch-invariant mode, each reduced in the same order).
 *
 * A decode step multiplies a few rows by every weight matrix, so it is bound by reading the
 * weights: each thread reads a contiguous run of output rows, ROWS at a time, and takes every
 * x row through them while they are in L1, so the weights cross the memory bus once per step.
 * Each tile asks for the next tile's weights as it reads its own (software prefetch: the
 * hardware prefetcher alone left a 2-core Xeon at 17.7 GB/s over SmolLM2's linears, against
 * 22.2 GB/s with it). bf16 weights are widened to float32 as they are read
 * (a shift or a mask, exact): a bf16 model reads half the bytes on CPUs without bf16
 * arithmetic, where torch's bf16 matmul is far slower than this.
 *
 * x: [M, K] float32 or bf16, contiguous; w: [N, K] float32 or bf16, contiguous; bias: [N]
 * float32 or NULL; y: [M, N] float32, or bf16 (rounded to nearest even, as torch rounds).
 */
#include "cpu_common.h"
#include "cpu_amx.h"

#include <stdlib.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define ROWS 4  /* weight rows per tile */
#define XROWS 2 /* x rows per tile: XROWS * ROWS accumulators, ROWS weight vectors in registers */
/* From WIDE_FROM rows: WIDE_XROWS x rows a tile (with AVX-512's 32 registers from 4 rows: a
 * weight vector then serves 4 x rows, not 2; on a 2-core Xeon with AMX, 4 and 8 rows by
 * Llama-3.2-1B's 8192x2048 went from 26.6 to 34.2 and from 17.6 to 21.0 GB/s in bf16, 1.3x
 * in float32). Past a decode step's few rows (only kernels.batch_invariant sends more), the
 * rows in chunks of CHUNK_ROWS, each chunk's x kept in L2 while every weight row passes it (x
 * whole would stream from L3 once per ROWS weight rows). Neither changes an output's order of
 * reduction, which is the same for every tile shape. */
#define WIDE_XROWS 4
#ifdef __AVX512F__
#define WIDE_FROM 4
#else
#define WIDE_FROM 16 /* 16 registers: 16 accumulators would spill */
#endif
#define CHUNK_ROWS 64

typedef uint32_t vu_u __attribute__((vector_size(VL * 4), aligned(2))); /* unaligned loads */

INLINE float w_at(const void *w, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

INLINE float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++)
        s += v[i];
    return s;
}

/* How a tile multiplies: float32 weights; bf16 weights widened (any x); bf16 weights and bf16
 * x through AVX512-BF16's dot product of pairs, where the CPU has it (one instruction for what
 * widening takes four: a step of a few rows is then bound by memory again, not by the core).
 * The products are exact either way, but vdpbf16ps adds each pair's two products before the
 * accumulator and flushes subnormal inputs and results to zero, so bf16 outputs differ in
 * their last bits between hosts with and without it (float32 weights never take it). */
enum { F32_WEIGHTS, BF16_WIDENED, BF16_DOT };
#ifdef __AVX512BF16__
#define HAS_BF16_DOT 1
#else
#define HAS_BF16_DOT 0
#endif

/* Rows n0 .. n0 + R of y for x rows m0 .. m0 + P: each weight vector is loaded once for the P
 * rows. A widened bf16 step reads 2 * VL weights as VL 32-bit lanes holding an even and an odd
 * one: the even ones become floats by a shift, the odd ones by masking the low half, and `xa`
 * holds x with each step's even and odd elements apart to match (a float32 step reads x
 * itself, a dot step the bf16 x, `xh`). R, P and kind are constants where this is inlined. */
INLINE void tile(const float *x, const float *xa, const uint16_t *xh, const void *w,
                 const float *bias, void *y, int y_bf16, int64_t N, int64_t K, int64_t m0,
                 int64_t n0, const int P, const int R, const int kind) {
    const int bf16 = kind != F32_WEIGHTS;
    const int64_t step = bf16 ? 2 * VL : VL;
    const int64_t kv = K - K % step;
    const int64_t esize = bf16 ? 2 : 4;
    /* the next tile's rows, or these again at the end of the matrix (never past it) */
    const char *ahead = (const char *)w + (n0 + 2 * ROWS <= N ? n0 + ROWS : n0) * K * esize;
    vf acc[WIDE_XROWS][ROWS];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            acc[p][r] = (vf){0};
    for (int64_t k = 0; k < kv; k += step) {
        for (int r = 0; r < R && R > 1; r++) /* a lone row is one stream: see rows_block */
            __builtin_prefetch(ahead + (r * K + k) * esize, 0, 3);
        if (R == 1)
            prefetch_stream((const char *)w + (n0 * K + k) * esize);
#if HAS_BF16_DOT
        if (kind == BF16_DOT) {
            __m512bh pairs[ROWS];
            for (int r = 0; r < R; r++)
                pairs[r] = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + (n0 + r) * K + k);
            for (int p = 0; p < P; p++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + (m0 + p) * K + k);
                for (int r = 0; r < R; r++)
                    acc[p][r] = (vf)_mm512_dpbf16_ps((__m512)acc[p][r], xv, pairs[r]);
            }
            continue;
        }
#endif
        if (bf16) {
            vu pairs[ROWS];
            for (int r = 0; r < R; r++)
                pairs[r] = *(const vu_u *)((const uint16_t *)w + (n0 + r) * K + k);
            for (int p = 0; p < P; p++) {
                const vf even = *(const vf_u *)(xa + (m0 + p) * K + k);
                const vf odd = *(const vf_u *)(xa + (m0 + p) * K + k + VL);
                for (int r = 0; r < R; r++) {
                    acc[p][r] += even * (vf)(pairs[r] << 16);
                    acc[p][r] += odd * (vf)(pairs[r] & 0xFFFF0000u);
                }
            }
        } else {
            vf wv[ROWS];
            for (int r = 0; r < R; r++)
                wv[r] = *(const vf_u *)((const float *)w + (n0 + r) * K + k);
            for (int p = 0; p < P; p++) {
                const vf xv = *(const vf_u *)(x + (m0 + p) * K + k);
                for (int r = 0; r < R; r++)
                    acc[p][r] += xv * wv[r];
            }
        }
    }
    for (int p = 0; p < P; p++) {
        const float *xm = x + (m0 + p) * K;
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[p][r]);
            for (int64_t k = kv; k < K; k++)
                s += xm[k] * w_at(w, (n0 + r) * K + k, bf16);
            store_out(y, y_bf16, (m0 + p) * N + n0 + r, s, bias, n0 + r);
        }
    }
}

/* Rows n0 .. n0 + R of y for x rows m .. M: XROWS x rows at a time (WIDE_XROWS for many)
 * while the R weight rows are in L1 (after the first tile they come from there, not from
 * memory). A lone x row takes the R weight rows one at a time instead, without the tiles'
 * prefetch of the next rows, so that a thread reads its run of rows as one sequential stream:
 * on a 2-core AVX512-BF16 EPYC, A/B in one process over Llama-3.2-1B's matrices, bf16 weights
 * through the dot product went from 34.8 to 45.7 GB/s (float32 weights and widened bf16: no
 * change). Two x rows gained nothing that way. That stream asks for its bytes STREAM_AHEAD on
 * (prefetch_stream): on a 2-core Xeon with AMX, the same A/B went from 25.2 to 36.7 GB/s with
 * the dot product, 30.0 to 36.9 in float32, 21.3 to 35.0 widened. Each output's order of
 * reduction is the tile's whatever R, so the results are the same bit for bit. */
INLINE void rows_block(const float *x, const float *xa, const uint16_t *xh, const void *w,
                       const float *bias, void *y, int y_bf16, int64_t m, int64_t M, int64_t N,
                       int64_t K, int64_t n0, const int R, const int kind) {
    if (M - m == 1) { /* a lone x row: one weight row after another */
        for (int r = 0; r < R; r++)
            tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0 + r, 1, 1, kind);
        return;
    }
    if (M - m >= WIDE_FROM)
        for (; m + WIDE_XROWS <= M; m += WIDE_XROWS)
            tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0, WIDE_XROWS, R, kind);
    for (; m + XROWS <= M; m += XROWS)
        tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0, XROWS, R, kind);
    for (; m < M; m++)
        tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0, 1, R, kind);
}

INLINE void linear_rows(const float *x, const float *xa, const uint16_t *xh, const void *w,
                        const float *bias, void *y, int y_bf16, int64_t M, int64_t N,
                        int64_t K, const int kind, int num_threads) {
    const int64_t full = N / ROWS;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < full; b++)
            rows_block(x, xa, xh, w, bias, y, y_bf16, m0, m1, N, K, b * ROWS, ROWS, kind);
        for (int64_t n = full * ROWS; n < N; n++) /* the last N % ROWS rows */
            rows_block(x, xa, xh, w, bias, y, y_bf16, m0, m1, N, K, n, 1, kind);
    }
}

#if HAS_AMX
/* bf16 rows by bf16 weights on AMX's tiles (see amx_rows in cpu_common.h), the weights as they
 * are: a decode step of up to AMX_M rows reads every weight once (a 2-core Xeon, 8192x2048:
 * 34-36 GB/s from 1 to 8 rows, where the dot product's tiles fell to 21 at 8 and torch's GEMM
 * on AMX read 25; 26.5 at 16 rows, 20.0 at 32, where x's tiles come from L2 as often as the
 * weights' from memory). Weight rows past the last whole block (N % AMX_BLOCK) take the dot
 * product's tile; inputs past the last 32 (K % 32) are added after, in float32. */
typedef struct {
    const float *xf;
    const uint16_t *xh, *w;
    const float *bias;
    void *y;
    int y_bf16;
    int64_t N, K;
} amx_bf16_job;

/* The outputs of a stored float32 tile (16 weight rows from n0 by P x rows from m0), with the
 * inputs past the last 32 added. */
static void amx_store(const amx_bf16_job *j, const float out[16][16], int64_t m0, int P,
                      int64_t n0) {
    const int64_t K = j->K;
    for (int i = 0; i < 16; i++)
        for (int p = 0; p < P; p++) {
            float s = out[i][p];
            for (int64_t k = K - K % 32; k < K; k++)
                s += j->xf[(m0 + p) * K + k] * bf16_to_f32(j->w[(n0 + i) * K + k]);
            store_out(j->y, j->y_bf16, (m0 + p) * j->N + n0 + i, s, j->bias, n0 + i);
        }
}

static void amx_block_bf16(const void *job, const uint16_t *xa, const uint16_t *xb, int64_t m0,
                           int Pa, int Pb, int64_t n0) {
    const amx_bf16_job *j = job;
    const int64_t K = j->K;
    const uint16_t *w0 = j->w + n0 * K;
    float out[4][16][16];
    amx_tiles(w0, w0 + 16 * K, K * 2, xa, xb, K - K % 32, Pa, Pb, out);
    amx_store(j, out[0], m0, Pa, n0);
    amx_store(j, out[1], m0, Pa, n0 + 16);
    if (Pb) {
        amx_store(j, out[2], m0 + Pa, Pb, n0);
        amx_store(j, out[3], m0 + Pa, Pb, n0 + 16);
    }
}

static void amx_tail_bf16(const void *job, int64_t m0, int64_t m1, int64_t n) {
    const amx_bf16_job *j = job;
    rows_block(j->xf, j->xf, j->xh, j->w, j->bias, j->y, j->y_bf16, m0, m1, j->N, j->K, n, 1,
               BF16_DOT);
}
#endif

void linear_small(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias,
                  void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    /* x as float32 (xf), and for bf16 weights with each step's 2 * VL elements split into
     * its even and its odd ones (xa) */
    const int dot = w_bf16 && x_bf16 && HAS_BF16_DOT; /* no split x: it reads the bf16 x */
    const int split_x = w_bf16 && !dot;
    float *buffer = NULL;
    if (x_bf16 || split_x)
        buffer = malloc((size_t)((x_bf16 + split_x) * M * K) * sizeof *buffer);
    const float *xf = x;
    if (x_bf16) {
        float *widened = buffer;
        for (int64_t i = 0; i < M * K; i++)
            widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = widened;
    }
    const float *xa = xf;
#if HAS_AMX
    if (dot && amx_permitted()) {
        const amx_bf16_job job = {xf, x, w, bias, y, y_bf16, N, K};
        amx_rows(x, M, N, K, num_threads, amx_block_bf16, amx_tail_bf16, &job);
        free(buffer);
        return;
    }
#endif
    if (dot) {
        linear_rows(xf, xa, x, w, bias, y, y_bf16, M, N, K, BF16_DOT, num_threads);
    } else if (split_x) {
        float *split = buffer + x_bf16 * M * K;
        const int64_t kv = K - K % (2 * VL);
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < kv; k += 2 * VL)
                for (int i = 0; i < VL; i++) {
                    split[m * K + k + i] = xf[m * K + k + 2 * i];
                    split[m * K + k + VL + i] = xf[m * K + k + 2 * i + 1];
                }
        xa = split;
        linear_rows(xf, xa, NULL, w, bias, y, y_bf16, M, N, K, BF16_WIDENED, num_threads);
    } else {
        linear_rows(xf, xa, NULL, w, bias, y, y_bf16, M, N, K, F32_WEIGHTS, num_threads);
    }
    free(buffer);
}

/* Whether bf16 rows by bf16 weights take AVX512-BF16's dot product in this build
 * (kernels.native.linear_max_rows sizes the kernel's row limit by it). */
int linear_has_bf16_dot(void) { return HAS_BF16_DOT; }

/* Whether bf16 rows by bf16 weights take AMX's tiles in this build and process. */
int linear_has_amx(void) {
#if HAS_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
