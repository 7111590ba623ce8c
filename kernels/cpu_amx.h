/* AMX's tiles for cpu_linear.c's bf16 rows by bf16 weights; part of each build's cache key,
 * as cpu_common.h is. Include after cpu_common.h. */
#ifndef KVBATCH_CPU_AMX_H
#define KVBATCH_CPU_AMX_H

/* AMX's tiles (bf16 rows by bf16 weight tiles, float32 sums): a tile of 16 weight rows by 32 inputs (64 bytes of each row, loaded with the
 * rows' stride, so the weights keep their row-major layout) times a tile of the same 32 inputs
 * of up to 16 x rows, packed as AMX wants its second operand (pairs of inputs side by side),
 * accumulates 16 outputs by those x rows in a float32 tile. A thread takes blocks of 2 x 16
 * weight rows, all of K, with up to 2 x 16 x rows (all 8 tile registers): one pass over the
 * weights for up to AMX_M rows. tdpbf16ps adds an output's products in the order of its
 * inputs, one instruction's 16 pairs after another, whatever the tile's other rows and
 * columns, so a row's result does not depend on the others (the batch-invariant mode's
 * linear). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_AMX 1
#define AMX_M 32     /* x rows per pass: two float32 tiles' 16 columns */
#define AMX_BLOCK 32 /* weight rows per block: two tiles of 16 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Whether this process may use the tile registers: Linux grants them on request (5.16 on). */
static inline int amx_permitted(void) {
    static int permitted = -1; /* every caller computes the same: a benign race */
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Tiles 2, 3: weights (16 rows by 32 bf16); 4 and 7: the first Pa and the next Pb x rows (16
 * input pairs by their rows); 0, 1 and 5, 6: float32 outputs of the two weight tiles by them
 * (tiles of no rows, where Pb is 0, are left unconfigured). */
static inline void amx_configure(int Pa, int Pb) {
    static const int pb_tiles[] = {5, 6, 7};
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = 16;
        c.colsb[t] = t == 2 || t == 3 ? 64 : Pa * 4;
    }
    for (int i = 0; i < 3 && Pb; i++) {
        c.rows[pb_tiles[i]] = 16;
        c.colsb[pb_tiles[i]] = Pb * 4;
    }
    _tile_loadconfig(&c);
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

/* The float32 sums of bf16 weight rows w0 .. w0 + 16 and w1 .. w1 + 16 (`stride` bytes apart)
 * over inputs 0 .. kv by the packed x rows xa (Pa of them) and xb (Pb): out[0], out[1] by xa,
 * out[2], out[3] by xb. */
static inline void amx_tiles(const uint16_t *w0, const uint16_t *w1, int64_t stride,
                             const uint16_t *xa, const uint16_t *xb, int64_t kv, int Pa, int Pb,
                             float out[4][16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    if (Pb) {
        _tile_zero(5);
        _tile_zero(6);
    }
    for (int64_t k = 0; k < kv; k += 32) {
        _tile_loadd(2, w0 + k, stride);
        _tile_loadd(3, w1 + k, stride);
        _tile_loadd(4, xa + k * Pa, Pa * 4);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
        if (Pb) {
            _tile_loadd(7, xb + k * Pb, Pb * 4);
            _tile_dpbf16ps(5, 2, 7);
            _tile_dpbf16ps(6, 3, 7);
        }
    }
    _tile_stored(0, out[0], 16 * 4);
    _tile_stored(1, out[1], 16 * 4);
    if (Pb) {
        _tile_stored(5, out[2], 16 * 4);
        _tile_stored(6, out[3], 16 * 4);
    }
}

/* A block: weight rows n0 .. n0 + AMX_BLOCK by x rows m0 .. m0 + Pa + Pb (xa, xb: packed). */
typedef void (*amx_block_fn)(const void *job, const uint16_t *xa, const uint16_t *xb, int64_t m0,
                             int Pa, int Pb, int64_t n0);
/* A weight row past the last whole block, n, by x rows m0 .. m1 (another path of the kernel:
 * which one depends on N alone, so a row's result still does not depend on the others). */
typedef void (*amx_tail_fn)(const void *job, int64_t m0, int64_t m1, int64_t n);

/* y for the M bf16 x rows xh ([M, K]) by N weight rows: AMX_M x rows a pass, the weights' whole
 * blocks shared by the threads. */
static inline void amx_rows(const uint16_t *xh, int64_t M, int64_t N, int64_t K, int num_threads,
                            amx_block_fn block, amx_tail_fn tail, const void *job) {
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
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                block(job, xp, xb, m0, Pa, Pb, b * AMX_BLOCK);
            _tile_release();
        }
        for (int64_t n = blocks * AMX_BLOCK; n < N; n++)
            tail(job, m0, m0 + P, n);
    }
    free(xp);
}
#else
#define HAS_AMX 0
#endif

#endif
