/* Linear layers over a few rows: y[m, :] = x[m, :] @ w^T (+ bias), float32 accumulation (any
 * number of rows in the batch-invariant mode, each reduced in the same order).
 *
 * A decode step multiplies a few rows by every weight matrix, so it is bound by reading the
 * weights: each thread reads a contiguous run of output rows, ROWS at a time, and takes every
 * x row through them while they are in L1, so the weights cross the memory bus once per step.
 * The tiles over a run of weight rows ask for the next rows' weights into L2 as they go, spread
 * over all of them (software prefetch: the hardware prefetcher alone left a 2-core Xeon at 17.7
 * GB/s over SmolLM2's linears, against 22.2 GB/s with a prefetch into L1 by the first tile; on
 * a 2-core Zen 4 EPYC, into L2 and spread, Llama-3.2-1B's matrices in bf16 went from 24.8 to
 * 29.3 GB/s at 4 rows, and with the weight vectors kept in registers (see tile) from 163 to
 * 220 GFLOP/s at 8 rows and 237 to 328 at 32). bf16 weights are widened to float32 as they are read
 * (a shift or a mask, exact): a bf16 model reads half the bytes on CPUs without bf16
 * arithmetic, where torch's bf16 matmul is far slower than this.
 *
 * x: [M, K] float32 or bf16, contiguous; w: [N, K] float32 or bf16, contiguous; bias: [N]
 * float32 or NULL; y: [M, N] float32, or bf16 (rounded to nearest even, as torch rounds).
 */
#include "cpu_common.h"
#include "cpu_amx.h"
#include "cpu_avx2.h"

#include <math.h>
#include <stdlib.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAS_AMX 1
#else
#define HAS_AMX 0
#endif

#define ROWS 4  /* weight rows per tile */
#define XROWS 2 /* x rows per tile: XROWS * ROWS accumulators, ROWS weight vectors in registers */
/* From WIDE_FROM rows: WIDE_XROWS x rows a tile (with AVX-512's 32 registers from 4 rows: a
 * weight vector then serves 4 x rows, not 2; on a 2-core Xeon with AMX, 4 and 8 rows by
 * Llama-3.2-1B's 8192x2048 went from 26.6 to 34.2 and from 17.6 to 21.0 GB/s in bf16, 1.3x
 * in float32). With AVX2's 16 registers a wide tile takes its weight rows WIDE_ROWS at a time
 * (8 accumulators; 4 x rows by all 4 weight rows spilled its 16 to the stack), from 6 rows: on
 * a 2-core AVX2 Zen 3 EPYC, A/B over the 1B's matrices, float32 1.13-1.17x at 6 rows and
 * 1.27-1.28x at 8, widened bf16 1.04-1.09x at 6-24 (4 rows were no faster). Past a decode
 * step's few rows (only kernels.batch_invariant sends more), the rows in chunks of CHUNK_ROWS,
 * each chunk's x kept in L2 while every weight row passes it (x whole would stream from L3 once
 * per ROWS weight rows). None of this changes an output's order of reduction, which is the same
 * for every tile shape. */
#define WIDE_XROWS 4
#ifdef __AVX512F__
#define WIDE_FROM 4
#define WIDE_ROWS ROWS
#else
#define WIDE_FROM 6
#define WIDE_ROWS 2 /* weight rows a wide tile takes at a time */
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
 * The products are exact either way, but vdpbf16ps adds a pair's two products to the
 * accumulator one after the other (the odd one first), each rounded, and flushes subnormal
 * inputs and results to zero, so bf16 outputs differ in their last bits between hosts with and
 * without it (float32 weights never take it). */
enum { F32_WEIGHTS, BF16_WIDENED, BF16_DOT };
#ifdef __AVX512BF16__
#define HAS_BF16_DOT 1
/* A dot tile's 16 lanes summed as a tree (halves, then quarters...): the same order for every
 * output and tile shape, in a few shuffles instead of hsum's 15 dependent adds (8% at 32 rows
 * of 2048 inputs, on the same EPYC). */
INLINE float hsum_dot(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
#define HAS_BF16_DOT 0
#define hsum_dot hsum
#endif

/* Rows n0 .. n0 + R of y for x rows m0 .. m0 + P: each weight vector is loaded once for the P
 * rows. A widened bf16 step reads 2 * VL weights as VL 32-bit lanes holding an even and an odd
 * one: the even ones become floats by a shift, the odd ones by masking the low half, and `xa`
 * holds x with each step's even and odd elements apart to match (a float32 step reads x
 * itself, a dot step the bf16 x, `xh`). R, P and kind are constants where this is inlined.
 *
 * With R > 1 the tile also asks for its share of the next tile's weights into L2: the cache
 * lines `line` .. `line + lines` past `ahead`, spread evenly over its steps (rows_block gives
 * each of the tiles that pass the same weight rows its share, so the next rows arrive while
 * all of them run, not only the first). */
INLINE void tile(const float *x, const float *xa, const uint16_t *xh, const void *w,
                 const float *bias, void *y, int y_bf16, int64_t N, int64_t K, int64_t m0,
                 int64_t n0, const char *ahead, int64_t line, int64_t lines, const int P,
                 const int R, const int kind) {
    const int bf16 = kind != F32_WEIGHTS;
    const int64_t step = bf16 ? 2 * VL : VL;
    const int64_t kv = K - K % step;
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t steps = kv / step;
    int64_t due = 0; /* lines * (steps so far) - steps * (lines asked for): Bresenham's count */
    vf acc[WIDE_XROWS][ROWS];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            acc[p][r] = (vf){0};
    for (int64_t k = 0; k < kv; k += step) {
        if (R > 1) /* a lone row is one stream: see rows_block */
            for (due += lines; due >= steps; due -= steps)
                __builtin_prefetch(ahead + 64 * line++, 0, 2);
        if (R == 1)
            prefetch_stream((const char *)w + (n0 * K + k) * esize);
#if HAS_BF16_DOT
        if (kind == BF16_DOT) {
            __m512bh pairs[ROWS];
            for (int r = 0; r < R; r++) {
                pairs[r] = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + (n0 + r) * K + k);
                /* kept in a register for the P rows: gcc 12 loaded it again for each x row,
                 * two loads a product (with the weights in L2, 1.55x at 32 rows on a 2-core
                 * Zen 4 EPYC) */
                IN_REGISTER(pairs[r]);
            }
            for (int p = 0; p < P; p++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + (m0 + p) * K + k);
                for (int r = 0; r < R; r++)
                    acc[p][r] = (vf)_mm512_dpbf16_ps((__m512)acc[p][r], xv, pairs[r]);
            }
            continue;
        }
#endif
        if (bf16) {
            vf lo[ROWS], hi[ROWS];
            for (int r = 0; r < R; r++) {
                const vu pairs = *(const vu_u *)((const uint16_t *)w + (n0 + r) * K + k);
                lo[r] = (vf)(pairs << 16);
                hi[r] = (vf)(pairs & 0xFFFF0000u);
                IN_REGISTERS(lo[r], hi[r]); /* as the dot tile's pairs */
            }
            for (int p = 0; p < P; p++) {
                const vf even = *(const vf_u *)(xa + (m0 + p) * K + k);
                const vf odd = *(const vf_u *)(xa + (m0 + p) * K + k + VL);
                for (int r = 0; r < R; r++) {
                    acc[p][r] += even * lo[r];
                    acc[p][r] += odd * hi[r];
                }
            }
        } else {
            vf wv[ROWS];
            for (int r = 0; r < R; r++) {
                wv[r] = *(const vf_u *)((const float *)w + (n0 + r) * K + k);
                IN_REGISTER(wv[r]); /* as the dot tile's pairs */
            }
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
            float s = kind == BF16_DOT ? hsum_dot(acc[p][r]) : hsum(acc[p][r]);
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
            tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0 + r, NULL, 0, 0, 1, 1, kind);
        return;
    }
    const int wide = M - m >= WIDE_FROM;
    const int64_t rest = wide ? (M - m) % WIDE_XROWS : M - m;
    const int64_t passes = (wide ? (M - m) / WIDE_XROWS : 0) + rest / XROWS + rest % XROWS;
    /* the next tile's rows, or these again at the end of the matrix (never past it) */
    const int64_t esize = kind == F32_WEIGHTS ? 4 : 2;
    const char *ahead = (const char *)w + (n0 + 2 * R <= N ? n0 + R : n0) * K * esize;
    const int64_t lines = (R * K * esize + 63) / 64;
    int64_t pass = 0;
    /* P x rows by the R weight rows, RT of them at a time; the pass's share of the prefetch
     * goes with the first RT */
#define TILE(P, RT)                                                                           \
    for (int h = 0; h < R; h += (RT))                                                         \
        tile(x, xa, xh, w, bias, y, y_bf16, N, K, m, n0 + h, ahead, pass * lines / passes,    \
             h ? 0 : (pass + 1) * lines / passes - pass * lines / passes, P, RT, kind)
    if (wide)
        for (; m + WIDE_XROWS <= M; m += WIDE_XROWS, pass++)
            TILE(WIDE_XROWS, R < WIDE_ROWS ? R : WIDE_ROWS);
    for (; m + XROWS <= M; m += XROWS, pass++)
        TILE(XROWS, R);
    for (; m < M; m++, pass++)
        TILE(1, R);
#undef TILE
}

/* rows_block with `kind` a constant in each branch. GCC outlines an OpenMP loop's body into a
 * function of its own before it inlines, so linear_rows' one body serves every kind: a kind
 * passed down as a variable was tested in each tile's every step, and the kinds' tiles shared
 * one set of registers (spilling pointers and a mask to the stack). On a 2-core AVX2 Zen 3
 * EPYC, A/B over Llama-3.2-1B's matrices, the same bits: widened bf16 1.07-1.16x at 6-32 rows,
 * float32 1.11-1.14x at 16-32 (on a 2-core Zen 4 EPYC float32 1.25-1.40x at 8-32). The dot
 * product's tiles stay in the shared body, `kind` a variable: specialised, their loop has no
 * stack reloads, yet it read the 1B's matrices from memory 1.02-1.17x slower at 1-16 rows on
 * that Zen 4 (no prefetch distance or level tried brought it back; the cause is not known). */
INLINE void rows_block_of(const float *x, const float *xa, const uint16_t *xh, const void *w,
                          const float *bias, void *y, int y_bf16, int64_t m, int64_t M,
                          int64_t N, int64_t K, int64_t n0, const int R, int kind) {
    switch (kind) {
    case F32_WEIGHTS:
        rows_block(x, xa, xh, w, bias, y, y_bf16, m, M, N, K, n0, R, F32_WEIGHTS);
        break;
    case BF16_WIDENED:
        rows_block(x, xa, xh, w, bias, y, y_bf16, m, M, N, K, n0, R, BF16_WIDENED);
        break;
#if HAS_BF16_DOT
    default: /* BF16_DOT, `kind` left a variable (a `case` would make it a constant) */
        rows_block(x, xa, xh, w, bias, y, y_bf16, m, M, N, K, n0, R, kind);
#endif
    }
}

INLINE void linear_rows(const float *x, const float *xa, const uint16_t *xh, const void *w,
                        const float *bias, void *y, int y_bf16, int64_t M, int64_t N,
                        int64_t K, int kind, int num_threads) {
    const int64_t full = N / ROWS;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < full; b++)
            rows_block_of(x, xa, xh, w, bias, y, y_bf16, m0, m1, N, K, b * ROWS, ROWS, kind);
        for (int64_t n = full * ROWS; n < N; n++) /* the last N % ROWS rows */
            rows_block_of(x, xa, xh, w, bias, y, y_bf16, m0, m1, N, K, n, 1, kind);
    }
}

#if HAS_AMX
/* bf16 rows by bf16 weights on AMX's tiles (float32 sums): a tile of 16 weight rows by 32
 * inputs (64 bytes of each row, loaded with the rows' stride, so the weights keep their
 * row-major layout) times a tile of the same 32 inputs of up to 16 x rows, packed as AMX wants
 * its second operand (pairs of inputs side by side), accumulates 16 outputs by those x rows in
 * a float32 tile. A thread takes blocks of 16 weight rows, all of K, with up to 2 x 16 x rows:
 * one pass over the weights for up to AMX_M rows. (Against blocks of 32 rows, two weight tiles
 * reading 32 rows' streams at once, on a 2-core Xeon with AMX: 1.03-1.09x at 24 x rows,
 * 1.06-1.11x at 32, the same to 16; blocks of 8 rows were 0.89-0.98x.) tdpbf16ps adds an
 * output's products in the order of its inputs, one instruction's 16 pairs after another,
 * whatever the tile's other rows and columns, so a row's result does not depend on the others
 * (the batch-invariant mode's linear). */
#define AMX_M 32     /* x rows per pass: two float32 tiles' 16 columns */
#define AMX_BLOCK 16 /* weight rows per block: one tile */

/* Tile 2: weights (16 rows by 32 bf16); 4 and 7: the first Pa and the next Pb x rows (16 input
 * pairs by their rows); 0 and 5: float32 outputs of the weights by them (tiles 5 and 7 are
 * left unconfigured where Pb is 0). */
static inline void amx_configure(int Pa, int Pb) {
    amx_tile_config((const int[8]){Pa * 4, 0, 64, 0, Pa * 4, Pb * 4, 0, Pb * 4});
}

/* x rows m0 .. m0 + P (bf16) as the x tiles of each 32 inputs: [K / 32][16 pairs][P][2]. */
static inline void amx_pack(const uint16_t *xh, int64_t K, int64_t m0, int P, uint16_t *xp) {
    for (int64_t kb = 0; kb < K / 32; kb++)
        for (int r = 0; r < 16; r++)
            for (int p = 0; p < P; p++) {
                const uint16_t *src = xh + (m0 + p) * K + kb * 32 + 2 * r;
                uint16_t *dst = xp + ((kb * 16 + r) * P + p) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

/* The float32 sums of the 16 bf16 weight rows from w (`stride` bytes apart) over inputs
 * 0 .. kv by the packed x rows xa (Pa of them) and xb (Pb): out[0] by xa, out[1] by xb. */
static inline void amx_tiles(const uint16_t *w, int64_t stride, const uint16_t *xa,
                             const uint16_t *xb, int64_t kv, int Pa, int Pb,
                             float out[2][16][16]) {
    _tile_zero(0);
    if (Pb)
        _tile_zero(5);
    for (int64_t k = 0; k < kv; k += 32) {
        _tile_loadd(2, w + k, stride);
        _tile_loadd(4, xa + k * Pa, Pa * 4);
        _tile_dpbf16ps(0, 2, 4);
        if (Pb) {
            _tile_loadd(7, xb + k * Pb, Pb * 4);
            _tile_dpbf16ps(5, 2, 7);
        }
    }
    _tile_stored(0, out[0], 16 * 4);
    if (Pb)
        _tile_stored(5, out[1], 16 * 4);
}

/* The outputs of a stored float32 tile (16 weight rows from n0 by P x rows from m0), with the
 * inputs past the last 32 added: without them, an x row's 16 outputs as one run (the tile's
 * column copied out, then stored in a loop the compiler vectorises), else one at a time. */
static void amx_store(const float out[16][16], const float *xf, const uint16_t *w,
                      const float *bias, void *y, int y_bf16, int64_t N, int64_t K, int64_t m0,
                      int P, int64_t n0) {
    if (K % 32 == 0) {
        for (int p = 0; p < P; p++) {
            float column[16];
            for (int i = 0; i < 16; i++)
                column[i] = out[i][p];
            for (int i = 0; i < 16; i++)
                store_out(y, y_bf16, (m0 + p) * N + n0 + i, column[i], bias, n0 + i);
        }
        return;
    }
    for (int i = 0; i < 16; i++)
        for (int p = 0; p < P; p++) {
            float s = out[i][p];
            for (int64_t k = K - K % 32; k < K; k++)
                s += xf[(m0 + p) * K + k] * bf16_to_f32(w[(n0 + i) * K + k]);
            store_out(y, y_bf16, (m0 + p) * N + n0 + i, s, bias, n0 + i);
        }
}

/* y for the M bf16 x rows xh ([M, K]) by N bf16 weight rows: AMX_M x rows a pass, the weights'
 * whole blocks (AMX_BLOCK rows) shared by the threads; a decode step of up to AMX_M rows reads
 * every weight once (a 2-core Xeon, 8192x2048: 34-36 GB/s from 1 to 8 rows, where the dot
 * product's tiles fell to 21 at 8 and torch's GEMM on AMX read 25; 26.5 at 16 rows, 20.0 at
 * 32, with blocks of 32 weight rows and one output a store). The tiles' own loop reads 26
 * GB/s at 32 rows on a second such Xeon, where the kernel read 18: storing the outputs one
 * at a time and widening x for nothing took the rest (16 outputs a store and x widened only
 * for the tails: 1.12x at 16 rows, 1.23-1.25x at 32).
 * Weight rows past the last whole block (N % AMX_BLOCK: which ones depends on N alone) take the
 * dot product's tile; inputs past the last 32 (K % 32) are added after, in float32 (x as float32,
 * xf, is made only where there are any: the dot product's tile reads it for those alone). */
static void linear_amx(const float *xf, const uint16_t *xh, const uint16_t *w,
                       const float *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                       int num_threads) {
    const int64_t blocks = N / AMX_BLOCK, kv = K - K % 32;
    uint16_t *xp = malloc((size_t)kv * AMX_M * sizeof *xp + 64);
    for (int64_t m0 = 0; m0 < M; m0 += AMX_M) {
        const int P = M - m0 < AMX_M ? (int)(M - m0) : AMX_M;
        const int Pa = P < 16 ? P : 16, Pb = P - Pa;
        uint16_t *xb = xp + kv * Pa;
        amx_pack(xh, K, m0, Pa, xp);
        amx_pack(xh, K, m0 + Pa, Pb, xb);
#pragma omp parallel num_threads(num_threads)
        {
            amx_configure(Pa, Pb);
            float out[2][16][16];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                amx_tiles(w + b * AMX_BLOCK * K, K * 2, xp, xb, kv, Pa, Pb, out);
                amx_store(out[0], xf, w, bias, y, y_bf16, N, K, m0, Pa, b * AMX_BLOCK);
                if (Pb)
                    amx_store(out[1], xf, w, bias, y, y_bf16, N, K, m0 + Pa, Pb, b * AMX_BLOCK);
            }
            _tile_release();
        }
        for (int64_t n = blocks * AMX_BLOCK; n < N; n++)
            rows_block(xf, xf, xh, w, bias, y, y_bf16, m0, m0 + P, N, K, n, 1, BF16_DOT);
    }
    free(xp);
}
#endif

#if HAS_BF16_DOT
/* bf16 rows by bf16 weights from COLUMNS_FROM rows, outside the batch-invariant mode: the
 * outputs as lanes. x's rows are packed as pairs of inputs, 16 rows a vector ([K / 2][rows][2]
 * 32-bit lanes), and each weight row's pair of inputs is broadcast to every lane, so one
 * vdpbf16ps adds a pair's products for 16 x rows of one output. A tile takes Pv vectors (32 to
 * 64 x rows) by R weight rows (Pv * R = 24 accumulators, R broadcasts a step), and reads its
 * weight rows once for all those rows, in one pass over K: no horizontal sums at the end, and
 * the x pairs and the weights' 4 bytes a step come from L1 and L2 at a fraction of the dot
 * tiles' traffic (which load a weight vector and an x vector for every 4 products).
 *
 * On a 2-core Zen 4 EPYC (AVX512-BF16, 452 GFLOP/s of vdpbf16ps on both cores), the dot tiles
 * ran Llama-3.2-1B's matrices at 54% of one core's peak on one thread, weights in L2 or not;
 * this ran them at 330-390 GFLOP/s on both from 32 rows (1.0-1.4x the tiles at 32-256 rows,
 * best of 9 in turn; torch's GEMM 1.0-1.4x slower to 96 rows, faster from 128). Below 32 rows
 * its vectors are part-filled or its broadcasts too many: 16 rows 0.84-1.0x the tiles, 24 rows
 * 0.83-0.88x.
 *
 * Each output is its pairs' products added in the order of K whatever the rows (a lane is one x
 * row), but not in the dot tiles' order (16 lanes over K, then a tree): the batch-invariant
 * mode keeps the tiles at every row count (linear_fixed). */
#define COLUMNS_FROM 32
#define COLUMNS_ACC 24    /* accumulators a tile: Pv * R */

/* Outputs n0 .. n0 + R of the x rows m0 .. m0 + P, packed in xp (Pv vectors). The weight rows
 * are K * 2 bytes apart, a multiple of 4 KiB for most models: their bytes of one step share an
 * L1 set, and reading 12 or 24 of them at once thrashed its 8 ways (16 rows ran at 100 GFLOP/s).
 * So every 16 steps the tile copies the rows' next 64 bytes into `stage`, one contiguous block,
 * and broadcasts from there (16 rows: 256 GFLOP/s). That copy asks for no bytes ahead: the row
 * streams' prefetch (STREAM_AHEAD on) fell on this tile's own rows two further down at the same
 * step; without it the 1B's matrices ran 1.02-1.04x faster at 32-96 rows on that EPYC
 * (bench.kernel_ab, 2 threads; one thread 1.06x at 32 rows). Pv and R are constants where
 * inlined. */
INLINE void columns_tile(const uint32_t *xp, const uint16_t *xh, const uint16_t *w,
                         const float *bias, void *y, int y_bf16, int64_t N, int64_t K,
                         int64_t m0, int P, int64_t n0, const int Pv, const int R) {
    const int lanes = Pv * 16;
    const int64_t pairs = K / 2;
    const uint16_t *wr = w + n0 * K;
    __m512 acc[COLUMNS_VECTORS][COLUMNS_ACC];
    int32_t stage[COLUMNS_ACC * 16] __attribute__((aligned(64)));
    for (int v = 0; v < Pv; v++)
        for (int r = 0; r < R; r++)
            acc[v][r] = _mm512_setzero_ps();
    for (int64_t jb = 0; jb < pairs; jb += 16) {
        const int64_t steps = pairs - jb < 16 ? pairs - jb : 16;
        if (steps == 16) {
#pragma GCC unroll 24
            for (int r = 0; r < R; r++) {
                _mm512_store_si512(stage + r * 16, _mm512_loadu_si512(wr + r * K + 2 * jb));
            }
        } else {
            for (int r = 0; r < R; r++)
                memcpy(stage + r * 16, wr + r * K + 2 * jb, (size_t)steps * 4);
        }
        for (int64_t s = 0; s < steps; s++) {
            __m512bh xv[COLUMNS_VECTORS];
            for (int v = 0; v < Pv; v++)
                xv[v] = (__m512bh)_mm512_loadu_si512(xp + (jb + s) * lanes + v * 16);
#pragma GCC unroll 24
            for (int r = 0; r < R; r++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32(stage[r * 16 + s]);
                for (int v = 0; v < Pv; v++)
                    acc[v][r] = _mm512_dpbf16_ps(acc[v][r], xv[v], b);
            }
        }
    }
    float out[COLUMNS_ACC][COLUMNS_VECTORS * 16];
    for (int v = 0; v < Pv; v++)
        for (int r = 0; r < R; r++)
            _mm512_storeu_ps(&out[r][v * 16], acc[v][r]);
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++) {
            float s = out[r][p];
            if (K % 2) /* the last input, past the pairs */
                s += bf16_to_f32(xh[(m0 + p) * K + K - 1]) * bf16_to_f32(wr[r * K + K - 1]);
            store_out(y, y_bf16, (m0 + p) * N + n0 + r, s, bias, n0 + r);
        }
}

/* The tiles of Pv vectors over every weight row: COLUMNS_ACC / Pv rows a tile, shared by the
 * threads; the rows past the last whole tile one at a time. */
#define COLUMNS_PASS(PV)                                                                      \
    {                                                                                         \
        const int64_t tiles = N / (COLUMNS_ACC / (PV));                                       \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t t = 0; t < tiles; t++)                                                   \
            columns_tile(xp, xh, w, bias, y, y_bf16, N, K, m0, P, t * (COLUMNS_ACC / (PV)),   \
                         PV, COLUMNS_ACC / (PV));                                             \
        for (int64_t n = tiles * (COLUMNS_ACC / (PV)); n < N; n++)                            \
            columns_tile(xp, xh, w, bias, y, y_bf16, N, K, m0, P, n, PV, 1);                  \
    }

/* y for the M bf16 x rows xh ([M, K]) by N bf16 weight rows, in passes of 2 to
 * COLUMNS_VECTORS vectors of 16 rows (columns_pass_vectors). */
static void linear_columns(const uint16_t *xh, const uint16_t *w, const float *bias, void *y,
                           int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    /* room for the widest pass, whatever the split */
    uint32_t *xp = malloc((size_t)(K / 2 + 1) * 16 * COLUMNS_VECTORS * sizeof *xp);
    COLUMNS_PASSES(M, columns_pack(xh, K, K / 2, m0, P, 16 * Pv, xp))
    free(xp);
}
#undef COLUMNS_PASS
#else
#define COLUMNS_FROM 0 /* no columns in this build */
#endif

#if defined(__AVX2__) && defined(__FMA__) && !HAS_BF16_DOT
#define HAS_PACKED 1
/* Many rows where the build has no bf16 dot product (float32 weights, or bf16 widened; x as
 * float32), outside the batch-invariant mode, as a GEMM with the outputs as lanes: a thread
 * takes a block of PACKED_ROWS weight rows (two vectors' worth), packs PACKED_K of their inputs
 * at a time as float32 ([PACKED_K][PACKED_ROWS]: an input's rows in two vectors, in L1), and
 * takes every x row through them PACKED_M at a time: each x value broadcast, multiplied by the
 * two weight vectors and added into 2 * PACKED_M accumulators, which leave the registers only
 * between two packed runs of inputs (into `sums`, [M][PACKED_ROWS]). The tiles above keep VL
 * inputs a lane and sum the lanes at the end; with AVX2's 16 registers they reload x for every
 * two weight rows, and widen each bf16 weight again for every x tile.
 *
 * Each output is its products added one after another in the order of K, from 0, each fused
 * into the sum (an FMA), whatever the rows (a lane is one weight row): the same for every row
 * count from PACKED_FROM, but not the tiles' order, so the batch-invariant mode keeps the tiles
 * (linear_fixed). The tiles multiply and add apart; here FMAs: on a 2-core AVX2 Zen 3 EPYC,
 * 12 independent chains ran 81 GFLOP/s on a core as FMAs against 59-67 as a multiply and an
 * add, and this kernel 1.1-1.3x faster (bf16 products are exact, so bf16 rows by bf16 weights
 * get the same bits either way). From PACKED_FROM rows (the 1B's matrices, 2 threads) it beat
 * the tiles 1.0-1.6x to 128 rows, and torch's GEMM at every row count (see kernels/native.py:
 * LINEAR_MAX_ROWS_PACKED). With AVX-512 (a 2-core Xeon without AVX512-BF16) 1.2-1.9x the tiles
 * from 24 rows, and torch's GEMM to 96 rows of float32 weights and 192 of bf16 ones (a tie at
 * 256), whole decode steps to 128 and 256 (LINEAR_MAX_ROWS_PACKED_AVX512); asking for the next
 * run's weights while this one is packed gained 1.01-1.10x there (not measured on AVX2).
 * Neither the block, the tile nor PACKED_K changes an output's order. */
#define PACKED_ROWS (2 * VL) /* weight rows a block: two vectors */
#define PACKED_FROM 24 /* below it the tiles win (one pass over the weights, no packing) */
#ifdef __AVX512F__
typedef __m512 packed_vec;
#define packed_load _mm512_load_ps
#define packed_loadu _mm512_loadu_ps
#define packed_storeu _mm512_storeu_ps
#define PACKED_M 12  /* x rows a tile: 24 accumulators, 2 weight vectors, a broadcast x */
#define PACKED_K 128 /* inputs packed at a time: 16 KiB of float32 */
#else
typedef __m256 packed_vec;
#define packed_load _mm256_load_ps
#define packed_loadu _mm256_loadu_ps
#define packed_storeu _mm256_storeu_ps
#define PACKED_M 6   /* x rows a tile: 12 accumulators, 2 weight vectors, a broadcast x */
#define PACKED_K 256 /* inputs packed at a time: 16 KiB of float32 */
#endif
_Static_assert(PACKED_M == 6 || PACKED_M == 12, "packed_block's last tiles: cases to 5 or 11");

/* Weight rows n0 .. n0 + rows (rows <= PACKED_ROWS; the others zero) from w, inputs k0 .. k0 +
 * kc (a multiple of 8), as float32 into pk ([kc][PACKED_ROWS]): 8 inputs of 8 rows a time,
 * transposed. Each cache line read asks for the one `ahead` weights on into L2: the next run's
 * (of this block, or the next block's first). */
INLINE void packed_weights(const void *w, int64_t K, int64_t n0, int rows, int64_t k0,
                           int64_t kc, int64_t ahead, float *pk, const int bf16) {
    for (int h = 0; h < PACKED_ROWS / 8; h++)
        for (int64_t k = 0; k < kc; k += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                const int64_t row = 8 * h + i, at = (n0 + row) * K + k0 + k;
                if (row >= rows)
                    r[i] = _mm256_setzero_si256();
                else if (bf16)
                    r[i] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                                 (const __m128i *)((const uint16_t *)w + at))),
                                             16);
                else
                    r[i] = _mm256_loadu_si256((const __m256i *)((const float *)w + at));
                if (row < rows && k % (bf16 ? 32 : 16) == 0)
                    __builtin_prefetch((const char *)w + (at + ahead) * (bf16 ? 2 : 4), 0, 2);
            }
            transpose8_epi32(r);
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i *)(pk + (k + j) * PACKED_ROWS + 8 * h), r[j]);
        }
}

/* An x value broadcast, times the two weight vectors, added into its row's two accumulators
 * (fused). In asm, as cpu_int8.c's packed_step: from intrinsics GCC copies sums between
 * registers and spills accumulators. */
INLINE void packed_f32_step(packed_vec *lo, packed_vec *hi, const float *x, packed_vec w0,
                            packed_vec w1) {
    packed_vec t;
    __asm__("vbroadcastss %[x], %[t]\n\t"
            "vfmadd231ps %[w0], %[t], %[a0]\n\t"
            "vfmadd231ps %[w1], %[t], %[a1]"
            : [a0] "+&v"(*lo), [a1] "+v"(*hi), [t] "=&v"(t) /* a0 written before w1 is read */
            : [x] "m"(*x), [w0] "v"(w0), [w1] "v"(w1));
}

/* x rows m0 .. m0 + P (P a constant where inlined) by packed inputs k0 .. k0 + kc, added into
 * their sums. */
INLINE void packed_tile(const float *xf, int64_t K, int64_t m0, int64_t k0, int64_t kc,
                        const float *pk, float *sums, const int P) {
    packed_vec lo[PACKED_M], hi[PACKED_M];
    for (int p = 0; p < P; p++) {
        lo[p] = packed_loadu(sums + (m0 + p) * PACKED_ROWS);
        hi[p] = packed_loadu(sums + (m0 + p) * PACKED_ROWS + VL);
    }
    const float *xr = xf + m0 * K + k0;
    for (int64_t k = 0; k < kc; k++) {
        const packed_vec w0 = packed_load(pk + k * PACKED_ROWS),
                         w1 = packed_load(pk + k * PACKED_ROWS + VL);
        for (int p = 0; p < P; p++)
            packed_f32_step(&lo[p], &hi[p], xr + p * K + k, w0, w1);
    }
    for (int p = 0; p < P; p++) {
        packed_storeu(sums + (m0 + p) * PACKED_ROWS, lo[p]);
        packed_storeu(sums + (m0 + p) * PACKED_ROWS + VL, hi[p]);
    }
}

/* Weight rows n0 .. n0 + rows by all M x rows, stored: inputs a packed run at a time, the
 * inputs past the last 8 added after (in order and fused, as the lanes add theirs). */
INLINE void packed_block(const float *xf, const void *w, const float *bias, void *y,
                         int y_bf16, int64_t M, int64_t N, int64_t K, int64_t n0, int rows,
                         float *pk, float *sums, const int bf16) {
    const int64_t kv = K - K % 8;
    memset(sums, 0, (size_t)M * PACKED_ROWS * sizeof *sums);
    for (int64_t k0 = 0; k0 < kv; k0 += PACKED_K) {
        const int64_t kc = kv - k0 < PACKED_K ? kv - k0 : PACKED_K;
        const int64_t ahead = k0 + kc < kv ? PACKED_K : PACKED_ROWS * K - k0;
        packed_weights(w, K, n0, rows, k0, kc, ahead, pk, bf16);
        int64_t m0 = 0;
        for (; m0 + PACKED_M <= M; m0 += PACKED_M)
            packed_tile(xf, K, m0, k0, kc, pk, sums, PACKED_M);
        switch (M - m0) { /* the last tile's rows, a constant in each call (to PACKED_M - 1) */
#define PACKED_LAST(P)                                                                             \
    case P: packed_tile(xf, K, m0, k0, kc, pk, sums, P); break;
#if PACKED_M > 6
            PACKED_LAST(11) PACKED_LAST(10) PACKED_LAST(9) PACKED_LAST(8) PACKED_LAST(7)
            PACKED_LAST(6)
#endif
            PACKED_LAST(5) PACKED_LAST(4) PACKED_LAST(3) PACKED_LAST(2) PACKED_LAST(1)
#undef PACKED_LAST
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int i = 0; i < rows; i++) {
            float s = sums[m * PACKED_ROWS + i];
            for (int64_t k = kv; k < K; k++)
                s = __builtin_fmaf(xf[m * K + k], w_at(w, (n0 + i) * K + k, bf16), s);
            store_out(y, y_bf16, m * N + n0 + i, s, bias, n0 + i);
        }
}

/* y for the M float32 x rows xf by N float32 or bf16 weight rows, blocks of PACKED_ROWS weight
 * rows shared by the threads (the last block's rows past N packed as zeros). */
static void linear_packed(const float *xf, const void *w, int w_bf16, const float *bias,
                          void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                          int num_threads) {
    const int64_t blocks = (N + PACKED_ROWS - 1) / PACKED_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        float *pk = aligned_alloc(64, PACKED_K * PACKED_ROWS * sizeof *pk);
        float *sums = malloc((size_t)M * PACKED_ROWS * sizeof *sums);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * PACKED_ROWS;
            const int rows = N - n0 < PACKED_ROWS ? (int)(N - n0) : PACKED_ROWS;
            if (w_bf16)
                packed_block(xf, w, bias, y, y_bf16, M, N, K, n0, rows, pk, sums, 1);
            else
                packed_block(xf, w, bias, y, y_bf16, M, N, K, n0, rows, pk, sums, 0);
        }
        free(sums);
        free(pk);
    }
}
#else
#define HAS_PACKED 0
#define PACKED_FROM 0 /* no packed GEMM in this build */
#endif

/* bf16 rows by bf16 weights packed once, at load, for the dot product (linear_packed_dot):
 * the weights as [N / 32][K / 2][32] pairs of inputs, a block of 32 rows a pair at a time, so
 * that one 64-byte load holds one pair of 16 rows (a vector's lanes) and the block streams as
 * one run. x's pair of inputs is broadcast to every lane, and one vdpbf16ps adds that pair's
 * products for 16 outputs of one x row: a tile takes PDOT_M x rows by the block's 32 rows (24
 * accumulators; 2 weight loads and PDOT_M broadcasts a pair) over all of K in registers, with
 * no horizontal sums and no packing in the call (the per-call packed GEMM spends more on the
 * transposes than on the products at decode's row counts). The block stays in L2 while every
 * tile of a chunk of x passes it, so each weight byte comes from memory once a chunk
 * (pdot_chunk_tiles: once a call up to a few hundred rows).
 *
 * Each output is its pairs' products added in the order of K from 0, whatever the rows (a lane
 * is one weight row): the columns' order, the same bits, and the same for every row count, so
 * the batch-invariant mode takes it as it is. Built where there is no dot product, the same
 * sums in C (each pair's odd product added, then its even one, as vdpbf16ps's definition
 * does; the same bits but where vdpbf16ps flushes subnormals), so the layout works everywhere,
 * though only the dot product's builds pack (see kernels/native.py: packs_bf16). */
#define PDOT_ROWS 32 /* weight rows a block */
#define PDOT_M 12    /* x rows a tile: 24 accumulators */
#define PDOT_PACK_X 9 /* x rows from which x is packed, in tiles of 6 to 12 rows (fewer:
                       * PDOT_DIRECT's cases) */
#if HAS_BF16_DOT
/* x's pair broadcast, by the block's two vectors of a pair, added into a row's two
 * accumulators. In asm, as packed_f32_step. */
INLINE void pdot_step(__m512 *lo, __m512 *hi, const uint32_t *x, __m512 w0, __m512 w1) {
    __m512 t;
    __asm__("vpbroadcastd %[x], %[t]\n\t"
            "vdpbf16ps %[w0], %[t], %[a0]\n\t"
            "vdpbf16ps %[w1], %[t], %[a1]"
            : [a0] "+&v"(*lo), [a1] "+v"(*hi), [t] "=&v"(t)
            : [x] "m"(*x), [w0] "v"(w0), [w1] "v"(w1));
}
#endif

/* sums[p][r] for P x rows (pair j of row p at xt[p * R + j * S]; P and S constants where
 * inlined) by the packed block wb ([pairs][32]). The first tile to read the block asks for its
 * bytes STREAM_AHEAD on. */
INLINE void pdot_tile(const uint32_t *xt, int64_t R, const uint32_t *wb, int64_t pairs,
                      float sums[PDOT_M][PDOT_ROWS], const int P, const int S, int stream) {
#if HAS_BF16_DOT
    __m512 lo[PDOT_M], hi[PDOT_M];
    for (int p = 0; p < P; p++)
        lo[p] = hi[p] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        if (stream) {
            prefetch_stream(wb + j * PDOT_ROWS);
            prefetch_stream(wb + j * PDOT_ROWS + 16);
        }
        /* unaligned loads: a packed weight need not start on a line (a view, numpy's memory) */
        const __m512 w0 = _mm512_loadu_ps((const float *)wb + j * PDOT_ROWS);
        const __m512 w1 = _mm512_loadu_ps((const float *)wb + j * PDOT_ROWS + 16);
        for (int p = 0; p < P; p++)
            pdot_step(&lo[p], &hi[p], xt + p * R + j * S, w0, w1);
    }
    for (int p = 0; p < P; p++) {
        _mm512_storeu_ps(sums[p], lo[p]);
        _mm512_storeu_ps(sums[p] + 16, hi[p]);
    }
#else
    (void)stream;
    for (int p = 0; p < P; p++)
        for (int r = 0; r < PDOT_ROWS; r++)
            sums[p][r] = 0.0f;
    for (int64_t j = 0; j < pairs; j++)
        for (int p = 0; p < P; p++) {
            const uint32_t xv = xt[p * R + j * S];
            const float xe = bf16_to_f32((uint16_t)xv), xo = bf16_to_f32((uint16_t)(xv >> 16));
            for (int r = 0; r < PDOT_ROWS; r++) {
                const uint32_t wv = wb[j * PDOT_ROWS + r];
                sums[p][r] += xo * bf16_to_f32((uint16_t)(wv >> 16));
                sums[p][r] += xe * bf16_to_f32((uint16_t)wv);
            }
        }
#endif
}

/* x rows m0 .. m0 + P of a tile (as pdot_tile reads them) by block b, stored. */
INLINE void pdot_rows(const uint32_t *xt, int64_t R, const uint32_t *wp, const float *bias,
                      void *y, int y_bf16, int64_t N, int64_t pairs, int64_t b, int64_t m0,
                      const int P, const int S, int stream) {
    float sums[PDOT_M][PDOT_ROWS] __attribute__((aligned(64)));
    pdot_tile(xt, R, wp + b * pairs * PDOT_ROWS, pairs, sums, P, S, stream);
    for (int p = 0; p < P; p++)
        for (int r = 0; r < PDOT_ROWS; r++)
            store_out(y, y_bf16, (m0 + p) * N + b * PDOT_ROWS + r, sums[p][r], bias,
                      b * PDOT_ROWS + r);
}

/* Tiles of packed x a block takes before the next block (a chunk; the blocks then pass again
 * for the next chunk): so many that the chunk's PDOT_CHUNK_BYTES stay in L3 while the weight
 * streams past them, where all of a prefill's x would come from memory again for every block.
 * On a 2-core Zen 4 EPYC (32 MiB L3; 2026-12-07), the 1B's 2048x8192 at a prefill's 1,600 rows
 * on both cores: 0.75, 1.5, 3 and 6 MiB chunks ran 398, 404, 419-426 and 408 GFLOP/s, all of
 * x at once 340-360 (its 2048-input matrices gain less: their x is a quarter the size); the
 * 1B's four matrices at 1,600 rows 1.09x, with x packed by both threads 1.02-1.03x at 96-512
 * (bench/kernel_ab.py --kind bf16-packed). */
#define PDOT_CHUNK_BYTES (3 << 20)
INLINE int64_t pdot_chunk_tiles(int64_t pairs) {
    const int64_t tiles = PDOT_CHUNK_BYTES / (pairs * PDOT_M * (int64_t)sizeof(uint32_t));
    return tiles > 0 ? tiles : 1;
}

/* y = x @ w^T (+ bias) for M bf16 x rows by N (a multiple of PDOT_ROWS) weight rows packed as
 * linear_packed_dot says, K even. From PDOT_PACK_X rows x is packed a tile at a time ([pairs]
 * [PDOT_M]: a step's broadcasts in one line; x's own rows, K * 2 bytes apart, share L1 sets),
 * tiles as even as the rows allow; fewer rows are read as they are: packing them cost more than
 * it saved (the 1B's 64 layer matrices on a 2-core Zen 4 EPYC, x packed against read as it is:
 * 54.7 against 46.7 ms at 2 rows, 44.3 against 40.3 at 6, 42.6 against 40.9 at 8; from 10
 * rows unpacked x lost, 58.8 against 50.3). The threads pack x's tiles together, then share
 * the blocks a chunk of tiles at a time (pdot_chunk_tiles). */
static void linear_packed_dot(const void *x, const void *wp, const float *bias, void *y,
                              int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t pairs = K / 2, blocks = N / PDOT_ROWS;
    const uint32_t *x2 = x, *w2 = wp;
    if (M < PDOT_PACK_X) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < blocks; b++)
            switch (M) { /* a constant in each call */
#define PDOT_DIRECT(P)                                                                        \
    case P: pdot_rows(x2, pairs, w2, bias, y, y_bf16, N, pairs, b, 0, P, 1, 1); break;
                PDOT_DIRECT(1) PDOT_DIRECT(2) PDOT_DIRECT(3) PDOT_DIRECT(4)
                PDOT_DIRECT(5) PDOT_DIRECT(6) PDOT_DIRECT(7) PDOT_DIRECT(8)
#undef PDOT_DIRECT
            }
        return;
    }
    const int64_t tiles = (M + PDOT_M - 1) / PDOT_M;
    const size_t xp_bytes = (size_t)(tiles * pairs * PDOT_M) * sizeof(uint32_t);
    uint32_t *xp = aligned_alloc(64, (xp_bytes + 63) & ~(size_t)63); /* a multiple of 64 */
    const int64_t chunk = pdot_chunk_tiles(pairs);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) /* the columns' packing, PDOT_M lanes a step */
            columns_pack(x, K, pairs, t * M / tiles, (int)((t + 1) * M / tiles - t * M / tiles),
                         PDOT_M, xp + t * pairs * PDOT_M);
        for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
            const int64_t c1 = c0 + chunk < tiles ? c0 + chunk : tiles;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++)
                for (int64_t t = c0; t < c1; t++) {
                    const int64_t m0 = t * M / tiles;
                    const uint32_t *xt = xp + t * pairs * PDOT_M;
                    switch ((t + 1) * M / tiles - m0) { /* the tile's rows (6 to 12), a constant */
#define PDOT_CASE(P)                                                                          \
    case P: pdot_rows(xt, 1, w2, bias, y, y_bf16, N, pairs, b, m0, P, PDOT_M, t == c0); break;
                        PDOT_CASE(6) PDOT_CASE(7) PDOT_CASE(8) PDOT_CASE(9) PDOT_CASE(10)
                        PDOT_CASE(11) PDOT_CASE(12)
#undef PDOT_CASE
                    }
                }
        }
    }
    free(xp);
}

/* The bf16 weight w ([N][K], N a multiple of PDOT_ROWS, K even) packed in place as
 * linear_packed_dot reads it: block b, rows 32b .. 32b + 32, already holds the bytes its packed
 * form takes, so each block is copied out and written back transposed (a block's bytes of
 * scratch a thread, no second copy of the weight). */
void linear_pack_dot(void *w, int64_t N, int64_t K, int num_threads) {
    const int64_t pairs = K / 2, blocks = N / PDOT_ROWS;
    uint32_t *w2 = w;
#pragma omp parallel num_threads(num_threads)
    {
        uint32_t *rows = malloc((size_t)(PDOT_ROWS * pairs) * sizeof *rows);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            uint32_t *block = w2 + b * PDOT_ROWS * pairs;
            memcpy(rows, block, (size_t)(PDOT_ROWS * pairs) * sizeof *rows);
            for (int64_t j = 0; j < pairs; j++)
                for (int r = 0; r < PDOT_ROWS; r++)
                    block[j * PDOT_ROWS + r] = rows[r * pairs + j];
        }
        free(rows);
    }
}

int linear_has_amx(void);

/* The linear for M rows; with fixed_order, each output reduced in one order fixed by K alone
 * (the tiles, or AMX's, at every row count: the batch-invariant mode's), else by the fastest
 * kernel for M. */
static void linear(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias,
                   void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads,
                   int fixed_order) {
    if (w_bf16 == 2) { /* packed for the dot product (bf16 x): every row count, either order */
        linear_packed_dot(x, w, bias, y, y_bf16, M, N, K, num_threads);
        return;
    }
    /* x as float32 (xf), and for bf16 weights with each step's 2 * VL elements split into its
     * even and its odd ones (xa). The dot product and AMX's tiles read the bf16 x: xf then
     * serves only the inputs past the last 2 * VL (32, AMX's step too), and is made only where
     * there are any. */
    const int dot = w_bf16 && x_bf16 && HAS_BF16_DOT; /* no split x: it reads the bf16 x */
#if HAS_BF16_DOT
    if (dot && !fixed_order && M >= COLUMNS_FROM && !linear_has_amx()) { /* the bf16 x only */
        linear_columns(x, w, bias, y, y_bf16, M, N, K, num_threads);
        return;
    }
#endif
    const int packed = HAS_PACKED && !fixed_order && M >= PACKED_FROM; /* float32 x only */
    const int split_x = w_bf16 && !dot && !packed;
    const int widen = x_bf16 && (!dot || K % (2 * VL));
    float *buffer = NULL;
    if (widen || split_x)
        buffer = malloc((size_t)((widen + split_x) * M * K) * sizeof *buffer);
    const float *xf = x;
    if (widen) {
        float *widened = buffer;
        for (int64_t i = 0; i < M * K; i++)
            widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = widened;
    }
    const float *xa = xf;
#if HAS_AMX
    if (dot && amx_permitted()) {
        linear_amx(xf, x, w, bias, y, y_bf16, M, N, K, num_threads);
        free(buffer);
        return;
    }
#endif
#if HAS_PACKED
    if (packed) {
        linear_packed(xf, w, w_bf16, bias, y, y_bf16, M, N, K, num_threads);
        free(buffer);
        return;
    }
#endif
    if (dot) {
        linear_rows(xf, xa, x, w, bias, y, y_bf16, M, N, K, BF16_DOT, num_threads);
    } else if (split_x) {
        float *split = buffer + widen * M * K;
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

/* y = x @ w^T (+ bias) for the M rows of x: bf16 rows by bf16 weights from COLUMNS_FROM rows
 * through the columns (where the build has them and AMX does not take them), any rows from
 * PACKED_FROM through the packed GEMM (builds without the dot product), else the tiles. w_bf16
 * is 0 for float32 weights, 1 for bf16, 2 for bf16 packed for the dot product (bf16 x). */
void linear_small(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias,
                  void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    linear(x, x_bf16, w, w_bf16, bias, y, y_bf16, M, N, K, num_threads, 0);
}

/* The same with each output reduced in one order fixed by K alone, whatever M: the tiles (or
 * AMX's) at every row count, for kernels.batch_invariant. */
void linear_fixed(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias,
                  void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
    linear(x, x_bf16, w, w_bf16, bias, y, y_bf16, M, N, K, num_threads, 1);
}

/* One projection's LoRA adapters, by slot (kernels.lora's LoRASlots as native.LoRATable): slot
 * s adapts it when a[s] is not NULL, with a[s] [rank[s], K] and bt[s] [rank[s], N] (B
 * transposed, the scaling folded in) of the rows' dtype. */
struct lora_slots {
    int64_t num_slots;
    const void *const *a;
    const void *const *bt;
    const int64_t *rank;
};

/* lora_add's expand: outputs a block (a task), and multiply-adds from which it takes threads */
#define LORA_BLOCK 512
#define LORA_PARALLEL_FROM (1 << 16)

/* Rows of lora_add's expand at a time: their accumulators, LORA_VECTORS vectors each, stay in
 * registers (16 of AVX-512's 32; 8 of AVX2's 16) while Bt's vectors are read once for them. */
#define LORA_VECTORS 4
#define LORA_ROWS (VL == 16 ? 4 : 2)

/* VL bf16 values from p on, as float32: load_bf16 in two instructions where AVX-512 has them
 * (gcc 12 made load_bf16's conversion five a vector here: half the expand's instructions) */
INLINE vf lora_bf16(const uint16_t *p) {
#if VL == 16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)),
                                 16);
#else
    return load_bf16(p);
#endif
}

/* s in every lane: one broadcast (gcc 12 made `(vf){0} + s` an add and a broadcast, and a
 * lane-by-lane fill sixteen masked broadcasts) */
INLINE vf lora_splat(float s) {
#if VL == 16
    return (vf)_mm512_set1_ps(s);
#elif defined(__AVX2__) /* immintrin.h: cpu_avx2.h's */
    return (vf)_mm256_set1_ps(s);
#else
    return (vf){0} + s;
#endif
}

/* a * b + c, fused where the build has FMA (as fmaf is, in the tail) */
INLINE vf lora_fma(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__) /* immintrin.h: cpu_avx2.h's */
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* y's rows rows[0 .. K) at outputs n0 .. n1 += their shrunk rows (float32 [K, r]) @ bt
 * ([r, N]), each output summed over the rank in order, added to y and rounded once. K and
 * BF16 are constants where it is inlined, so the accumulators are registers. */
INLINE void lora_expand(const float *shrunk, int64_t r, const void *bt, const int BF16,
                        int64_t N, int64_t n0, int64_t n1, const int64_t *rows, const int K,
                        void *y) {
    const int64_t step = LORA_VECTORS * VL;
    int64_t n = n0;
    for (; n + step <= n1; n += step) {
        vf acc[LORA_ROWS][LORA_VECTORS];
        for (int i = 0; i < K; i++)
            for (int v = 0; v < LORA_VECTORS; v++)
                acc[i][v] = (vf){0};
        for (int64_t j = 0; j < r; j++) {
            vf b[LORA_VECTORS];
            for (int v = 0; v < LORA_VECTORS; v++)
                b[v] = BF16 ? lora_bf16((const uint16_t *)bt + j * N + n + v * VL)
                            : (vf) * (const vf_u *)((const float *)bt + j * N + n + v * VL);
            for (int i = 0; i < K; i++) {
                const vf c = lora_splat(shrunk[i * r + j]);
                for (int v = 0; v < LORA_VECTORS; v++)
                    acc[i][v] = lora_fma(c, b[v], acc[i][v]);
            }
        }
        for (int i = 0; i < K; i++) {
            float g[LORA_VECTORS * VL];
            for (int v = 0; v < LORA_VECTORS; v++)
                *(vf_u *)(g + v * VL) = acc[i][v];
            if (BF16) {
                uint16_t *out = (uint16_t *)y + rows[i] * N + n;
                for (int64_t e = 0; e < step; e++)
                    out[e] = f32_to_bf16(bf16_to_f32(out[e]) + g[e]);
            } else {
                float *out = (float *)y + rows[i] * N + n;
                for (int64_t e = 0; e < step; e++)
                    out[e] += g[e];
            }
        }
    }
    for (int i = 0; i < K; i++) /* the outputs past the last whole step */
        for (int64_t e = n; e < n1; e++) {
            float g = 0.0f;
            for (int64_t j = 0; j < r; j++) {
                const float b = BF16 ? bf16_to_f32(((const uint16_t *)bt)[j * N + e])
                                     : ((const float *)bt)[j * N + e];
                g = fmaf(shrunk[i * r + j], b, g);
            }
            if (BF16) {
                uint16_t *out = (uint16_t *)y + rows[i] * N + e;
                *out = f32_to_bf16(bf16_to_f32(*out) + g);
            } else {
                ((float *)y)[rows[i] * N + e] += g;
            }
        }
}

/* lora_expand for K (1 .. LORA_ROWS) rows, each count its own inlined copy */
static void lora_expand_rows(const float *shrunk, int64_t r, const void *bt, int bf16, int64_t N,
                             int64_t n0, int64_t n1, const int64_t *rows, int K, void *y) {
#define LORA_CASE(k)                                                                          \
    case k:                                                                                   \
        if (bf16)                                                                             \
            lora_expand(shrunk, r, bt, 1, N, n0, n1, rows, k, y);                             \
        else                                                                                  \
            lora_expand(shrunk, r, bt, 0, N, n0, n1, rows, k, y);                             \
        break;
    switch (K) {
    LORA_CASE(1)
    LORA_CASE(2)
#if LORA_ROWS > 2
    LORA_CASE(3)
    LORA_CASE(4)
#endif
    }
#undef LORA_CASE
}

/* y [M, N] += each row's adapter product: row m, whose slot s = slot_of[m] is one the projection
 * has (-1: the base model's row), gets (x[m] @ a[s]^T) @ bt[s]. The rows of a slot are shrunk
 * together into float32 [m, r], a[s] read once, by the linear's tiles at every row count
 * (linear_fixed's order: a row's result whatever the other rows; the columns, which the linear
 * takes for many bf16 rows, were 5x slower on a rank's few outputs, 0.153 against 0.028 ms for
 * 32 rows by 16 x 8192 on a Zen 4); each row is then expanded along N, a rank's row of bt at a
 * time (in one order whatever the rows), in float32, and added to y's row, rounded once (to
 * y's dtype, x's). */
void lora_add(const void *x, void *y, int bf16, const struct lora_slots *t,
              const int32_t *slot_of, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t elem = bf16 ? 2 : 4;
    int64_t max_rank = 0;
    for (int64_t s = 0; s < t->num_slots; s++)
        if (t->a[s] && t->rank[s] > max_rank)
            max_rank = t->rank[s];
    if (!max_rank)
        return;
    int64_t *rows = malloc((size_t)M * sizeof *rows);
    char *xs = NULL; /* a slot's rows gathered, where they are not contiguous */
    float *shrunk = malloc((size_t)(M * max_rank) * sizeof(float));
    for (int64_t s = 0; s < t->num_slots; s++) {
        if (!t->a[s])
            continue;
        int64_t m = 0;
        for (int64_t row = 0; row < M; row++)
            if (slot_of[row] == s)
                rows[m++] = row;
        if (!m)
            continue;
        const char *xm = (const char *)x + rows[0] * K * elem; /* the slot's rows, together */
        if (rows[m - 1] - rows[0] != m - 1) { /* not contiguous: gathered */
            if (!xs)
                xs = malloc((size_t)(M * K * elem));
            for (int64_t i = 0; i < m; i++)
                memcpy(xs + i * K * elem, (const char *)x + rows[i] * K * elem,
                       (size_t)(K * elem));
            xm = xs;
        }
        const int64_t r = t->rank[s];
        const void *bt = t->bt[s];
        linear(xm, bf16, t->a[s], bf16, NULL, shrunk, 0, m, r, K, num_threads, 1);
        /* the expand, by blocks of LORA_BLOCK outputs (the threads' share) */
#pragma omp parallel for num_threads(num_threads) if (m * r * N >= LORA_PARALLEL_FROM)
        for (int64_t n0 = 0; n0 < N; n0 += LORA_BLOCK) {
            const int64_t n1 = N - n0 < LORA_BLOCK ? N : n0 + LORA_BLOCK;
            for (int64_t i = 0; i < m; i += LORA_ROWS) {
                const int k = m - i < LORA_ROWS ? (int)(m - i) : LORA_ROWS;
                lora_expand_rows(shrunk + i * r, r, bt, bf16, N, n0, n1, rows + i, k, y);
            }
        }
    }
    free(rows);
    free(xs);
    free(shrunk);
}

/* The rows from which bf16 rows by bf16 weights take the columns in linear_small (0: never in
 * this build; AMX's tiles take them first where the process may use AMX). */
int linear_columns_from(void) { return COLUMNS_FROM; }

/* The rows from which linear_small takes the packed AVX2 GEMM (0: never in this build). */
int linear_packed_from(void) { return PACKED_FROM; }

/* Whether bf16 rows by bf16 weights take AVX512-BF16's dot product in this build
 * (kernels.native.linear_max_rows sizes the kernel's row limit by it). */
int linear_has_bf16_dot(void) { return HAS_BF16_DOT; }

/* Tiles of x a chunk of linear_packed_dot holds for K inputs (for the tests). */
int linear_packed_chunk_tiles(int64_t K) { return (int)pdot_chunk_tiles(K / 2); }

/* Floats a vector in this build: 8 for AVX2 (kernels.native.linear_max_rows sizes the float32
 * row limit by it), 16 for AVX-512. */
int linear_vector_floats(void) { return VL; }

/* Whether bf16 rows by bf16 weights take AMX's tiles in this build and process. */
int linear_has_amx(void) {
#if HAS_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
