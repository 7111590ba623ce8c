/* Weight-only int8 linear layers: y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * q[n, k]
 * (+ bias[n]), float32 accumulation, symmetric int8 weights with one float32 scale per group of
 * G consecutive inputs of an output row (G = K: one scale per output channel; G = 32: GGUF's
 * Q8_0 blocks exactly).
 *
 * A decode step is bound by reading the weights; int8 ones are half the bytes of bf16. Each
 * thread reads a contiguous run of output rows, ROWS at a time, and takes every x row through
 * them while they are in L1 (as cpu_linear.c does), widening the int8 weights to float32 in
 * registers. Per-channel scales (G = K, or any G not a multiple of VL): per group, a float32
 * accumulator of x * q, folded into the row's total by one FMA with the group's scale (not a
 * horizontal sum per group). Small groups that are whole vectors (Q8_0's 32): each weight
 * vector multiplied by its scale as it is widened. Each output's order of reduction is fixed
 * by K and G alone, so a row's result does not depend on how many rows share the call.
 *
 * Three paths, chosen at build time (where the compiler targets the instructions) and forced
 * to the portable one at run time by `portable` (the tests run each on one host):
 * - fixed point, per-channel scales and groups of 32, with AVX512-VNNI or AVX2: x rows as
 *   int16, 32 weights at a time sign-extended to int16, multiplied in pairs into int32 lanes
 *   (see linear_fixed below: with VNNI 4x fewer instructions a weight than the float path per
 *   channel, 2x for groups of 32; on a 2-core AVX2 EPYC a lone row went from 1.6 to 10.4 GB/s).
 *   Per channel from a dozen rows it runs as a GEMM where the build has AVX2 without VNNI
 *   (linear_packed), from 32 rows with the outputs as lanes where it has VNNI
 *   (linear_columns), and on AMX's int8 tiles where it has them (linear_amx_int8).
 * - AVX-512 (other groups): 16 int8 weights a load, sign-extended (vpmovsxbd) and
 *   converted (vcvtdq2ps) to float32, one FMA per x row.
 * - portable: GCC vector extensions of VL lanes, whatever the target (SSE2 up; on AVX2 the
 *   weights widened by vpmovsxbd, which GCC 12 leaves to a byte at a time).
 * The float paths multiply exact values, so only the weights' rounding separates them from the
 * float model; the fixed-point path adds x's rounding to int16, ~1e-4 of a row's largest
 * value.
 *
 * x: [M, K] float32 or bf16, contiguous; q: [N, K] int8, contiguous; scale: [N, K / G]
 * float32, contiguous (G divides K); bias: [N] float32 or NULL; y: [M, N] float32, or bf16
 * (rounded to nearest even, as torch rounds).
 */
#include "cpu_common.h"
#include "cpu_amx.h"
#include "cpu_avx2.h"

#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
#define HAS_AVX512 1
#else
#define HAS_AVX512 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif
#if HAS_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAS_AMX_INT8 1 /* per-channel int8 on AMX's int8 tiles (linear_amx_int8) */
#else
#define HAS_AMX_INT8 0
#endif
#if HAS_VNNI || (defined(__AVX2__) && defined(__FMA__))
#define HAS_FIXED 1 /* the fixed-point path: VNNI's, or AVX2's (vpmaddwd) */
#else
#define HAS_FIXED 0
#endif
/* x rows a call widens and quantizes at once (more go a chunk at a time), and from how many
 * rows it does so on every thread. */
#define CALL_ROWS 1024
#define PARALLEL_ROWS 16

/* The kernel a per-channel call runs (linear_int8_kernel). */
enum { KERNEL_TILES, KERNEL_AMX, KERNEL_PACKED, KERNEL_COLUMNS };
#if HAS_FIXED && !HAS_VNNI
#define HAS_PACKED 1 /* per-channel int8 as an AVX2 GEMM from PACKED_FROM rows (linear_packed) */
#else
#define HAS_PACKED 0
#endif
#define HAS_COLUMNS HAS_VNNI /* per channel with VNNI from COLUMNS_FROM rows (linear_columns) */

#define ROWS 4       /* weight rows per tile */
#define XROWS 4      /* x rows per tile: XROWS * ROWS accumulators per group, and as many totals */
#define CHUNK_ROWS 64 /* x rows per pass over the weights: their x stays in L2 */

typedef int8_t vq_u __attribute__((vector_size(VL), aligned(1)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

INLINE float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++)
        s += v[i];
    return s;
}

/* VL int8 weights from p on, as float32 (exact). */
INLINE vf load_q(const int8_t *p, const int avx512) {
#if HAS_AVX512
    if (avx512 && VL == 16)
        return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#endif
    (void)avx512;
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* the same values: GCC 12 widens the generic vector below a byte at a time */
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
    return __builtin_convertvector(__builtin_convertvector(*(const vq_u *)p, vi), vf);
}

/* Rows n0 .. n0 + R of y for x rows m0 .. m0 + P (R, P and avx512 are constants where this is
 * inlined). Within a group the vector part runs to the last whole VL, the rest is scalar; a
 * group that is whole vectors but not the whole row takes the scaled-weights loop. */
INLINE void tile(const float *x, const int8_t *q, const float *scale, const float *bias,
                 void *y, int y_bf16, int64_t N, int64_t K, int64_t G, int64_t m0, int64_t n0,
                 const int P, const int R, const int avx512) {
    const int64_t groups = K / G;
    /* the next tile's rows, or these again at the end of the matrix (never past it) */
    const int8_t *ahead = q + (n0 + 2 * ROWS <= N ? n0 + ROWS : n0) * K;
    vf total[XROWS][ROWS];
    float total_tail[XROWS][ROWS];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++) {
            total[p][r] = (vf){0};
            total_tail[p][r] = 0.0f;
        }
    if (G != K && G % VL == 0) {
        /* small groups (Q8_0's 32): each weight vector scaled as it is widened, one multiply
         * more a vector, where an accumulator per group cost three times the time */
        for (int64_t k = 0; k < K; k += VL) {
            if ((k & 63) == 0)
                for (int r = 0; r < R; r++)
                    __builtin_prefetch(ahead + r * K + k, 0, 3);
            vf wv[ROWS];
            for (int r = 0; r < R; r++)
                wv[r] = load_q(q + (n0 + r) * K + k, avx512) * scale[(n0 + r) * groups + k / G];
            for (int p = 0; p < P; p++) {
                const vf xv = *(const vf_u *)(x + (m0 + p) * K + k);
                for (int r = 0; r < R; r++)
                    total[p][r] += xv * wv[r];
            }
        }
    } else {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * G, k1 = k0 + G, kv = k0 + G - G % VL;
            vf acc[XROWS][ROWS];
            for (int p = 0; p < P; p++)
                for (int r = 0; r < R; r++)
                    acc[p][r] = (vf){0};
            for (int64_t k = k0; k < kv; k += VL) {
                if ((k & 63) == 0)
                    for (int r = 0; r < R; r++)
                        __builtin_prefetch(ahead + r * K + k, 0, 3);
                vf wv[ROWS];
                for (int r = 0; r < R; r++)
                    wv[r] = load_q(q + (n0 + r) * K + k, avx512);
                for (int p = 0; p < P; p++) {
                    const vf xv = *(const vf_u *)(x + (m0 + p) * K + k);
                    for (int r = 0; r < R; r++)
                        acc[p][r] += xv * wv[r];
                }
            }
            for (int r = 0; r < R; r++) {
                const float s = scale[(n0 + r) * groups + g];
                for (int p = 0; p < P; p++)
                    total[p][r] += acc[p][r] * s;
                if (kv == k1)
                    continue;
                for (int p = 0; p < P; p++) {
                    float t = 0.0f;
                    for (int64_t k = kv; k < k1; k++)
                        t += x[(m0 + p) * K + k] * (float)q[(n0 + r) * K + k];
                    total_tail[p][r] += t * s;
                }
            }
        }
    }
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++) {
            float s = hsum(total[p][r]) + total_tail[p][r];
            store_out(y, y_bf16, (m0 + p) * N + n0 + r, s, bias, n0 + r);
        }
}

INLINE void rows_block(const float *x, const int8_t *q, const float *scale, const float *bias,
                       void *y, int y_bf16, int64_t m, int64_t M, int64_t N, int64_t K,
                       int64_t G, int64_t n0, const int R, const int avx512) {
    for (; m + XROWS <= M; m += XROWS)
        tile(x, q, scale, bias, y, y_bf16, N, K, G, m, n0, XROWS, R, avx512);
    switch (M - m) {
    case 3: tile(x, q, scale, bias, y, y_bf16, N, K, G, m, n0, 3, R, avx512); break;
    case 2: tile(x, q, scale, bias, y, y_bf16, N, K, G, m, n0, 2, R, avx512); break;
    case 1: tile(x, q, scale, bias, y, y_bf16, N, K, G, m, n0, 1, R, avx512); break;
    default: break;
    }
}

INLINE void linear_rows(const float *x, const int8_t *q, const float *scale, const float *bias,
                        void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int64_t G,
                        const int avx512, int num_threads) {
    const int64_t full = N / ROWS;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < full; b++)
            rows_block(x, q, scale, bias, y, y_bf16, m0, m1, N, K, G, b * ROWS, ROWS, avx512);
        for (int64_t n = full * ROWS; n < N; n++) /* the last N % ROWS rows */
            rows_block(x, q, scale, bias, y, y_bf16, m0, m1, N, K, G, n, 1, avx512);
    }
}

#if HAS_FIXED
/* The fixed-point path, per-channel scales: x rows as int16 fixed point (each row's largest
 * magnitude at X16_MAX, rounded to nearest), 32 int8 weights sign-extended to int16 at a time,
 * multiplied in pairs into int32 lanes (dot32: AVX512-VNNI's vpdpwssd, or AVX2's vpmaddwd and
 * an add per 16): two instructions for what the float path takes eight with AVX-512 (which
 * left a core compute-bound at ~15 GB/s of int8 weights, under memory speed), and on AVX2
 * where the float path read 1.5-3 GB/s. The lanes hold at most 256 steps (K_CHUNK inputs; AVX2's
 * 8 lanes then hold 1024 products: 1024 * X16_MAX * 128 < 2^31) before they are added into the
 * output's int64 sum. So each output's sum of x * q is exact and is rounded to float once
 * (store_channel): AVX2, VNNI, AMX's tiles (linear_amx_int8), the packed GEMM
 * (linear_packed) and the columns (linear_columns) give the same bits, and which of them runs may depend on the row count
 * without breaking the batch-invariant mode. x's
 * rounding is at most half of max|x_m| / X16_MAX an element, far below the weights' own (half a
 * step of max|w_n| / 127), and a row's result depends on that row alone.
 *
 * Groups of 32 (GGUF's Q8_0): each group is one dot32 from zero, its lanes converted to float
 * and multiplied by the group's scale (see group_sum); the float path took eight instructions
 * a group where VNNI takes four. */
#if HAS_VNNI
#define MM(op) _mm512_##op /* an intrinsic of this width */
typedef __m512i v32;       /* 32 int16 */
typedef __m512i vacc;      /* int32 lanes */
typedef __m512 vfl;        /* float lanes */
INLINE v32 x32_load(const int16_t *p) { return _mm512_loadu_si512(p); }
INLINE v32 w32_load(const int8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
INLINE vacc dot32(vacc a, v32 x, v32 w) { return _mm512_dpwssd_epi32(a, x, w); }
INLINE vacc acc_zero(void) { return _mm512_setzero_si512(); }
INLINE float fl_sum(vfl v) { return _mm512_reduce_add_ps(v); }
INLINE int64_t acc_sum64(vacc a) { /* the lanes' exact sum */
    return _mm512_reduce_add_epi64(_mm512_add_epi64(
        _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
}
#else
#define MM(op) _mm256_##op
typedef struct { __m256i lo, hi; } v32;
typedef __m256i vacc;
typedef __m256 vfl;
INLINE v32 x32_load(const int16_t *p) {
    return (v32){_mm256_loadu_si256((const __m256i *)p),
                 _mm256_loadu_si256((const __m256i *)(p + 16))};
}
INLINE v32 w32_load(const int8_t *p) {
    return (v32){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
INLINE vacc dot32(vacc a, v32 x, v32 w) {
    return _mm256_add_epi32(a, _mm256_add_epi32(_mm256_madd_epi16(x.lo, w.lo),
                                                _mm256_madd_epi16(x.hi, w.hi)));
}
INLINE vacc acc_zero(void) { return _mm256_setzero_si256(); }
INLINE int64_t acc_sum64(vacc a) { /* the lanes' exact sum */
    const __m256i s = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}
INLINE float fl_sum(vfl v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif
INLINE vacc acc_add(vacc a, vacc b) { return MM(add_epi32)(a, b); }
INLINE vfl acc_float(vacc a) { return MM(cvtepi32_ps)(a); }
INLINE vfl fl_zero(void) { return MM(setzero_ps)(); }
INLINE vfl fl_set1(float f) { return MM(set1_ps)(f); }
INLINE vfl fl_add(vfl a, vfl b) { return MM(add_ps)(a, b); }
INLINE vfl fl_mul(vfl a, vfl b) { return MM(mul_ps)(a, b); }
INLINE vfl fl_fmadd(vfl a, vfl b, vfl c) { return MM(fmadd_ps)(a, b, c); }
#define X16_MAX 16383
#define K_CHUNK 8192

/* An output of per-channel weights: the exact sum of x * q rounded to float once, times x's
 * scale and the channel's. */
INLINE float channel_value(int64_t sum, float x_scale, float channel_scale) {
    return (float)sum * x_scale * channel_scale;
}

/* Output (m, n) of per-channel weights from its sum (the last K % 32 inputs added here). */
INLINE void store_channel(int64_t sum, const int16_t *xq, const float *xs, const int8_t *q,
                          const float *scale, const float *bias, void *y, int y_bf16, int64_t N,
                          int64_t K, int64_t Kp, int64_t m, int64_t n) {
    for (int64_t k = K - K % 32; k < K; k++)
        sum += (int64_t)xq[m * Kp + k] * q[n * K + k];
    store_out(y, y_bf16, m * N + n, channel_value(sum, xs[m], scale[n]), bias, n);
}

/* Outputs n0 .. n0 + 16 of x row m from their sums: as one run (a loop the compiler vectorises)
 * where K is whole steps of 32, else each through store_channel (which adds the tail). */
INLINE void store_channel16(const int64_t sums[16], const int16_t *xq, const float *xs,
                            const int8_t *q, const float *scale, const float *bias, void *y,
                            int y_bf16, int64_t N, int64_t K, int64_t Kp, int64_t m, int64_t n0) {
    if (K % 32) {
        for (int i = 0; i < 16; i++)
            store_channel(sums[i], xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0 + i);
        return;
    }
    float s[16];
    for (int i = 0; i < 16; i++)
        s[i] = channel_value(sums[i], xs[m], scale[n0 + i]);
    for (int i = 0; i < 16; i++)
        store_out(y, y_bf16, m * N + n0 + i, s[i], bias, n0 + i);
}

/* Output (m, n) of groups of 32 (whole groups: no tail): its float lanes, the groups' scales in
 * them already, times x's scale. */
INLINE void store_groups(vfl total, const float *xs, const float *bias, void *y, int y_bf16,
                         int64_t N, int64_t m, int64_t n) {
    store_out(y, y_bf16, m * N + n, fl_sum(total) * xs[m], bias, n);
}

/* One or two (`two`, a constant where inlined) groups of 32 of one output: x's int16 fixed
 * point by the int8 weights widened to int16 (x0, w0; x1, w1), each group's int32 lanes to
 * float times its scale, the pair summed before it joins the output's total (one add's latency
 * per 64 weights). tile_fixed and row_fixed both sum this way: the same bits. */
INLINE vfl group_sum(v32 x0, v32 w0, const float *s, v32 x1, v32 w1,
                        const int two) {
    const vfl t = fl_mul(acc_float(dot32(acc_zero(), x0, w0)),
                                   fl_set1(s[0]));
    if (!two)
        return t;
    return fl_fmadd(acc_float(dot32(acc_zero(), x1, w1)),
                           fl_set1(s[1]), t);
}

/* The groups k .. k + 32 (and k + 32 .. k + 64 with `two`) of a tile: weights loaded once for
 * the P x rows, x once for the R weight rows. */
INLINE void tile_groups(const int16_t *xq, const int8_t *q, const float *scale, int64_t K,
                        int64_t Kp, int64_t m0, int64_t n0, int64_t k, const int8_t *ahead,
                        int ahead_rows, vfl total[XROWS][ROWS], const int P, const int R,
                        const int two) {
    const int64_t groups = K / 32;
    v32 w0[ROWS], w1[ROWS];
    for (int r = 0; r < R; r++) {
        if (ahead_rows >> r & 1)
            __builtin_prefetch(ahead + r * K + k, 0, 2);
        w0[r] = w32_load(q + (n0 + r) * K + k);
        w1[r] = two ? w32_load(q + (n0 + r) * K + k + 32) : w0[r];
    }
    for (int p = 0; p < P; p++) {
        const v32 x0 = x32_load(xq + (m0 + p) * Kp + k);
        const v32 x1 = two ? x32_load(xq + (m0 + p) * Kp + k + 32) : x0;
        for (int r = 0; r < R; r++)
            total[p][r] = fl_add(
                total[p][r],
                group_sum(x0, w0[r], scale + (n0 + r) * groups + k / 32, x1, w1[r], two));
    }
}

/* Inputs c0 .. c1 (at most K_CHUNK, whole steps of 32) of a tile with per-channel scales,
 * summed in int32 lanes and added into the outputs' int64 sums. */
INLINE void tile_chunk(const int16_t *xq, const int8_t *q, int64_t K, int64_t Kp, int64_t m0,
                       int64_t n0, int64_t c0, int64_t c1, const int8_t *ahead,
                       int ahead_rows, int64_t sum[XROWS][ROWS], const int P, const int R) {
    vacc acc[XROWS][ROWS];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            acc[p][r] = acc_zero();
    for (int64_t k = c0; k < c1; k += 32) {
        if ((k & 63) == 0)
            for (int r = 0; r < R; r++)
                if (ahead_rows >> r & 1)
                    __builtin_prefetch(ahead + r * K + k, 0, 2);
        v32 wv[ROWS];
        for (int r = 0; r < R; r++)
            wv[r] = w32_load(q + (n0 + r) * K + k);
        for (int p = 0; p < P; p++) {
            const v32 xv = x32_load(xq + (m0 + p) * Kp + k);
            for (int r = 0; r < R; r++)
                acc[p][r] = dot32(acc[p][r], xv, wv[r]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            sum[p][r] += acc_sum64(acc[p][r]);
}

/* Rows n0 .. n0 + R of y for x rows m0 .. m0 + P, per-channel scales or (`grouped`) groups of
 * 32; P, R and grouped are constants where this is inlined. The tile asks for the next tile's
 * weight rows whose bits are set in `ahead_rows`, into L2 (rows_block_fixed shares them out). */
INLINE void tile_fixed(const int16_t *xq, const float *xs, const int8_t *q, const float *scale,
                      const float *bias, void *y, int y_bf16, int64_t N, int64_t K,
                      int64_t Kp, int64_t m0, int64_t n0, int ahead_rows, const int P,
                      const int R, const int grouped) {
    const int8_t *ahead = q + (n0 + 2 * ROWS <= N ? n0 + ROWS : n0) * K;
    if (grouped) {
        vfl total[XROWS][ROWS];
        for (int p = 0; p < P; p++)
            for (int r = 0; r < R; r++)
                total[p][r] = fl_zero();
        const int64_t k2 = K - K % 64;
        for (int64_t k = 0; k < k2; k += 64)
            tile_groups(xq, q, scale, K, Kp, m0, n0, k, ahead, ahead_rows, total, P, R, 1);
        if (k2 < K)
            tile_groups(xq, q, scale, K, Kp, m0, n0, k2, ahead, ahead_rows, total, P, R, 0);
        for (int p = 0; p < P; p++)
            for (int r = 0; r < R; r++)
                store_groups(total[p][r], xs, bias, y, y_bf16, N, m0 + p, n0 + r);
        return;
    }
    int64_t sum[XROWS][ROWS] = {{0}};
    const int64_t kv = K - K % 32;
    for (int64_t c0 = 0; c0 < kv; c0 += K_CHUNK)
        tile_chunk(xq, q, K, Kp, m0, n0, c0, c0 + K_CHUNK < kv ? c0 + K_CHUNK : kv, ahead,
                   ahead_rows, sum, P, R);
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            store_channel(sum[p][r], xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m0 + p,
                          n0 + r);
}

/* One x row by weight rows n0 .. n0 + R a row at a time, as cpu_linear.c reads for a lone
 * row (one sequential stream a thread, asking STREAM_AHEAD on). Per channel, FIXED_ACC int32
 * accumulators for consecutive steps (one would wait on vpdpwssd's latency); integer sums are
 * exact. Groups of 32 are summed as tile_groups sums them. So the result is tile_fixed's, bit
 * for bit. */
#define FIXED_ACC 4
INLINE void row_fixed(const int16_t *xq, const float *xs, const int8_t *q, const float *scale,
                     const float *bias, void *y, int y_bf16, int64_t N, int64_t K, int64_t Kp,
                     int64_t m, int64_t n0, const int R, const int grouped) {
    const int64_t kv = K - K % 32, k2 = K - K % 64, groups = K / 32;
    const int16_t *xr = xq + m * Kp;
    for (int r = 0; r < R; r++) {
        const int8_t *qr = q + (n0 + r) * K;
        const float *sr = scale + (n0 + r) * groups;
        if (grouped) {
            vfl total = fl_zero();
            for (int64_t k = 0; k < k2; k += 64) {
                prefetch_stream(qr + k);
                total = fl_add(
                    total, group_sum(x32_load(xr + k), w32_load(qr + k), sr + k / 32,
                                     x32_load(xr + k + 32), w32_load(qr + k + 32), 1));
            }
            if (k2 < K) {
                const v32 x0 = x32_load(xr + k2), w0 = w32_load(qr + k2);
                total = fl_add(total, group_sum(x0, w0, sr + k2 / 32, x0, w0, 0));
            }
            store_groups(total, xs, bias, y, y_bf16, N, m, n0 + r);
            continue;
        }
        int64_t sum = 0;
        for (int64_t c0 = 0; c0 < kv; c0 += K_CHUNK) {
            const int64_t c1 = c0 + K_CHUNK < kv ? c0 + K_CHUNK : kv;
            vacc acc[FIXED_ACC];
            for (int a = 0; a < FIXED_ACC; a++)
                acc[a] = acc_zero();
            int64_t k = c0;
            for (; k + FIXED_ACC * 32 <= c1; k += FIXED_ACC * 32) {
                prefetch_stream(qr + k);
                prefetch_stream(qr + k + 64);
                for (int a = 0; a < FIXED_ACC; a++)
                    acc[a] = dot32(acc[a], x32_load(xr + k + 32 * a), w32_load(qr + k + 32 * a));
            }
            for (; k < c1; k += 32)
                acc[0] = dot32(acc[0], x32_load(xr + k), w32_load(qr + k));
            for (int a = 1; a < FIXED_ACC; a++)
                acc[0] = acc_add(acc[0], acc[a]);
            sum += acc_sum64(acc[0]);
        }
        store_channel(sum, xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0 + r);
    }
}

/* The rows of ROWS whose next-tile prefetch tile `j` of `passes` makes (see rows_block_fixed). */
INLINE int ahead_rows(int64_t j, int64_t passes) {
    int mask = 0;
    for (int r = 0; r < ROWS; r++)
        if (r % passes == j)
            mask |= 1 << r;
    return mask;
}

INLINE void rows_block_fixed(const int16_t *xq, const float *xs, const int8_t *q,
                            const float *scale, const float *bias, void *y, int y_bf16,
                            int64_t m, int64_t M, int64_t N, int64_t K, int64_t Kp, int64_t n0,
                            const int R, const int grouped) {
    if (M - m == 1) {
        row_fixed(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0, R, grouped);
        return;
    }
    /* The tiles that pass these weight rows share out asking for the next ones: with `passes`
     * of them, tile j the rows r with r % passes == j (with more passes than rows, tile r row r
     * and the rest none), so the next rows arrive while all of them run, not only the first.
     * On a 2-core Zen 4 EPYC, per-channel int8 by the 1B's matrices read at 21-22 GB/s at 2-4
     * rows when the first tile asked for every row into L1, against 34 for a lone row. */
    const int64_t passes = (M - m) / XROWS + ((M - m) % XROWS != 0);
    int64_t j = 0;
    for (; m + XROWS <= M; m += XROWS, j++)
        tile_fixed(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0, ahead_rows(j, passes),
                   XROWS, R, grouped);
    const int last = ahead_rows(j, passes);
    switch (M - m) {
    case 3:
        tile_fixed(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0, last, 3, R, grouped);
        break;
    case 2:
        tile_fixed(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0, last, 2, R, grouped);
        break;
    case 1:
        tile_fixed(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m, n0, last, 1, R, grouped);
        break;
    default: break;
    }
}

/* ROWS weight rows from n0 by rows_block_fixed, `grouped` a constant in each branch without
 * VNNI: GCC outlines an OpenMP loop's body before it inlines (see cpu_linear.c's
 * rows_block_of), and on a 2-core AVX2 Zen 3 EPYC a lone row of the 1B's per-channel int8
 * matrices read 1.06-1.10x faster so. With VNNI (a 2-core Zen 4 EPYC) they read 0.94-0.99x as
 * fast at 2-32 rows, as the dot product's tiles did in cpu_linear.c, so `grouped` stays a
 * variable there: per channel 1.01-1.10x, groups of 32 0.93-1.07x (mostly 0.98). The same bits
 * either way. */
INLINE void rows_block_fixed_of(const int16_t *xq, const float *xs, const int8_t *q,
                                const float *scale, const float *bias, void *y, int y_bf16,
                                int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t Kp,
                                int64_t n0, int grouped) {
#if HAS_VNNI
    rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, m0, m1, N, K, Kp, n0, ROWS, grouped);
#else
    if (grouped)
        rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, m0, m1, N, K, Kp, n0, ROWS, 1);
    else
        rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, m0, m1, N, K, Kp, n0, ROWS, 0);
#endif
}

#if HAS_AMX_INT8
/* Per-channel int8 weights on AMX's int8 tiles. x's int16 fixed point (as above) is split into
 * a signed high byte and an unsigned low one, x = 256 * hi + lo (hi in -64 .. 63: |x| <=
 * X16_MAX); a tile of 16 weight rows by 64 inputs (64 bytes of each row, loaded with the rows'
 * stride: the weights keep their layout) times the same inputs of up to 16 x rows' hi bytes
 * (tdpbssd) and lo bytes (tdpbsud) accumulates two int32 tiles. So each output's sum of x * q
 * is exact, as an int64 (256 * hi's + lo's, the tiles stored every AMXQ_K_CHUNK inputs, before
 * lo's could pass 2^31: 65536 * 255 * 128 < 2^31), rounded to float once by store_channel: the
 * VNNI path's bits.
 * A thread takes blocks of 16 weight rows, all of K, with up to 2 x 16 x rows a pass (AMXQ_M):
 * one pass over the weights for up to 32 rows. From AMXQ_FROM rows: on a 2-core Xeon with AMX
 * (the 1B's four matrices, bf16 rows, GFLOP/s against the VNNI path's) 1.01x at 8 rows, 1.67x
 * at 16, 2.12x at 32, 2.13x at 64; at 1-4 rows it read 0.92-0.95x as fast. */
#define AMXQ_M 32
#define AMXQ_FROM 8
#define AMXQ_K_CHUNK 65536

/* Tile 0: weights (16 rows by 64 int8); 1 and 2: the hi and lo bytes of the first Pa x rows
 * (16 rows of 4 inputs by the x rows), 3 those of the next Pb, one after the other; 4 and 5:
 * the first Pa rows' hi and lo sums, 6 and 7 the next Pb's (3, 6 and 7 are left unconfigured
 * where Pb is 0). */
static inline void amxq_configure(int Pa, int Pb) {
    amx_tile_config((const int[8]){64, Pa * 4, Pa * 4, Pb * 4, Pa * 4, Pa * 4, Pb * 4, Pb * 4});
}

/* x rows m0 .. m0 + P (int16, Kp apart) as the hi and lo tiles of each 64 inputs to kv:
 * [kv / 64][16 quads][P][4] bytes each. */
static void amxq_pack(const int16_t *xq, int64_t Kp, int64_t kv, int64_t m0, int P, int8_t *hi,
                      uint8_t *lo) {
    for (int64_t k = 0; k < kv; k += 4)
        for (int p = 0; p < P; p++)
            for (int i = 0; i < 4; i++) {
                const int16_t v = xq[(m0 + p) * Kp + k + i];
                hi[(k / 4 * P + p) * 4 + i] = (int8_t)(v >> 8);
                lo[(k / 4 * P + p) * 4 + i] = (uint8_t)(v & 0xff);
            }
}

/* The exact sums of the 16 int8 weight rows from q (K apart) by x rows' hi and lo bytes over
 * inputs k0 .. k1 (whole steps of 64) added to sums[x row][weight row]: Pa rows from (ha, la),
 * Pb from (hb, lb). */
static inline void amxq_tiles(const int8_t *q, int64_t K, const int8_t *ha, const uint8_t *la,
                              const int8_t *hb, const uint8_t *lb, int64_t k0, int64_t k1,
                              int Pa, int Pb, int64_t sums[AMXQ_M][16]) {
    _tile_zero(4);
    _tile_zero(5);
    if (Pb) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t k = k0; k < k1; k += 64) {
        _tile_loadd(0, q + k, K);
        _tile_loadd(1, ha + k * Pa, Pa * 4);
        _tile_dpbssd(4, 0, 1);
        _tile_loadd(2, la + k * Pa, Pa * 4);
        _tile_dpbsud(5, 0, 2);
        if (Pb) {
            _tile_loadd(3, hb + k * Pb, Pb * 4);
            _tile_dpbssd(6, 0, 3);
            _tile_loadd(3, lb + k * Pb, Pb * 4);
            _tile_dpbsud(7, 0, 3);
        }
    }
    int32_t t[4][16][16];
    _tile_stored(4, t[0], 64);
    _tile_stored(5, t[1], 64);
    if (Pb) {
        _tile_stored(6, t[2], 64);
        _tile_stored(7, t[3], 64);
    }
    for (int i = 0; i < 16; i++) {
        for (int p = 0; p < Pa; p++)
            sums[p][i] += 256 * (int64_t)t[0][i][p] + t[1][i][p];
        for (int p = 0; p < Pb; p++)
            sums[Pa + p][i] += 256 * (int64_t)t[2][i][p] + t[3][i][p];
    }
}

/* y for M x rows (int16 fixed point xq, Kp apart, scales xs) by the per-channel int8 weights'
 * whole blocks of 16 rows; the inputs past the last 64 are added in integers, the rows past the
 * last block (N % 16) take the VNNI path. */
static void linear_amx_int8(const int16_t *xq, const float *xs, const int8_t *q,
                            const float *scale, const float *bias, void *y, int y_bf16,
                            int64_t M, int64_t N, int64_t K, int64_t Kp, int num_threads) {
    const int64_t blocks = N / 16, kv = K - K % 64;
    int8_t *hi = malloc((size_t)(2 * kv * (M < AMXQ_M ? M : AMXQ_M)) + 64);
    for (int64_t m0 = 0; m0 < M; m0 += AMXQ_M) {
        const int P = M - m0 < AMXQ_M ? (int)(M - m0) : AMXQ_M;
        const int Pa = P < 16 ? P : 16, Pb = P - Pa;
        uint8_t *lo = (uint8_t *)hi + kv * Pa;
        int8_t *hb = hi + 2 * kv * Pa;
        uint8_t *lb = (uint8_t *)hb + kv * Pb;
        amxq_pack(xq, Kp, kv, m0, Pa, hi, lo);
        amxq_pack(xq, Kp, kv, m0 + Pa, Pb, hb, lb);
#pragma omp parallel num_threads(num_threads)
        {
            amxq_configure(Pa, Pb);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * 16;
                int64_t sums[AMXQ_M][16] = {{0}};
                if (kv < K - K % 32) /* a step of 32 past the last 64 (store_channel adds the
                                        inputs past the last 32) */
                    for (int p = 0; p < P; p++)
                        for (int i = 0; i < 16; i++)
                            for (int64_t k = kv; k < K - K % 32; k++)
                                sums[p][i] += (int64_t)xq[(m0 + p) * Kp + k] * q[(n0 + i) * K + k];
                for (int64_t k0 = 0; k0 < kv; k0 += AMXQ_K_CHUNK)
                    amxq_tiles(q + n0 * K, K, hi, lo, hb, lb, k0,
                               k0 + AMXQ_K_CHUNK < kv ? k0 + AMXQ_K_CHUNK : kv, Pa, Pb, sums);
                for (int p = 0; p < P; p++)
                    store_channel16(sums[p], xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m0 + p,
                                    n0);
            }
            _tile_release();
        }
        for (int64_t n = blocks * 16; n < N; n++)
            rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, m0, m0 + P, N, K, Kp, n, 1, 0);
    }
    free(hi);
}
#endif

#if HAS_PACKED
/* Per-channel int8 weights by many x rows on AVX2, as a GEMM: a thread packs a block of 16
 * weight rows, all of K, sign-extended to int16 and interleaved in pairs of inputs ([K / 2][16
 * rows][2]: 64 bytes a pair, two vectors of 8 outputs), then takes every PK_M x rows through
 * it: each x row's pair of inputs broadcast to the 8 lanes (vpbroadcastd), vpmaddwd by the
 * two vectors, added into 2 * PK_M int32 accumulators, one output a lane. The tiles above keep
 * a dot product of 16 inputs a lane (a horizontal sum an output) and on AVX2 their 16
 * accumulators and 8 weight vectors do not fit 16 registers. A lane holds at most PK_K_CHUNK
 * products (1024 * X16_MAX * 128 < 2^31) before it is added into the output's int64 sum, so
 * the sums are exact and the bits are the tiles' (store_channel). */
#define PK_M 5            /* x rows a tile: 10 accumulators, 2 weight vectors, 2 products */
#define PK_K_CHUNK 1024   /* inputs a lane's int32 sum may hold */
#define PACKED_FROM 12 /* below it the tiles (one pass over the weights, no packing) win */

/* 16 weight rows from q (K apart), inputs 0 .. kv (whole steps of 16), packed into pk as
 * [kv / 2][16][2] int16: row r's 16 inputs sign-extended are 8 int32 pairs, and 8 rows' of
 * them transposed are 8 pairs' 8 rows. */
static void pack_pairs(const int8_t *q, int64_t K, int64_t kv, int16_t *pk) {
    for (int64_t k = 0; k < kv; k += 16)
        for (int h = 0; h < 2; h++) {
            __m256i r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(q + (8 * h + i) * K + k)));
            transpose8_epi32(r);
            for (int j = 0; j < 8; j++)
                _mm256_storeu_si256((__m256i *)(pk + (k + 2 * j) * 16 + 16 * h), r[j]);
        }
}

typedef int32_t pair16 __attribute__((may_alias, aligned(2))); /* two int16 inputs as one */

/* An x row's pair of inputs at x broadcast, by the two weight vectors, added into its two
 * accumulators. In asm: from intrinsics GCC kept each sum in a fresh register and copied it back
 * to the accumulator's (vmovdqa), 20 more instructions a step for 4 rows, and with 6 rows it
 * spilled 8 accumulators to the stack. */
INLINE void packed_step(__m256i *lo, __m256i *hi, const pair16 *x, __m256i w0, __m256i w1) {
    __m256i t0, t1;
    __asm__("vpbroadcastd %[x], %[t1]\n\t"
            "vpmaddwd %[w0], %[t1], %[t0]\n\t"
            "vpmaddwd %[w1], %[t1], %[t1]\n\t"
            "vpaddd %[t0], %[a0], %[a0]\n\t"
            "vpaddd %[t1], %[a1], %[a1]"
            : [a0] "+x"(*lo), [a1] "+x"(*hi), [t0] "=&x"(t0), [t1] "=&x"(t1)
            : [x] "m"(*x), [w0] "x"(w0), [w1] "x"(w1));
}

/* The exact sums of P (a constant where inlined) x rows from m0 by a packed block, inputs
 * 0 .. kv, into sums[p][16]. */
INLINE void packed_tile(const int16_t *xq, int64_t Kp, int64_t m0, const int16_t *pk,
                        int64_t kv, int64_t sums[PK_M][16], const int P) {
    const int16_t *xr[PK_M];
    for (int p = 0; p < P; p++)
        xr[p] = xq + (m0 + p) * Kp;
    for (int64_t c0 = 0; c0 < kv; c0 += PK_K_CHUNK) {
        const int64_t c1 = c0 + PK_K_CHUNK < kv ? c0 + PK_K_CHUNK : kv;
        __m256i lo[PK_M], hi[PK_M]; /* outputs 0-7 and 8-15 */
        for (int p = 0; p < P; p++)
            lo[p] = hi[p] = _mm256_setzero_si256();
        for (int64_t k = c0; k < c1; k += 2) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pk + k * 16));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pk + k * 16 + 16));
            for (int p = 0; p < P; p++)
                packed_step(&lo[p], &hi[p], (const pair16 *)(xr[p] + k), w0, w1);
        }
        for (int p = 0; p < P; p++)
            for (int h = 0; h < 2; h++) {
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, h ? hi[p] : lo[p]);
                for (int i = 0; i < 8; i++)
                    sums[p][8 * h + i] += lanes[i];
            }
    }
}

/* x rows m0 .. m0 + P (P <= PK_M) by a packed block of weight rows n0 .. n0 + 16, stored. */
INLINE void packed_rows(const int16_t *xq, const float *xs, const int8_t *q, const float *scale,
                        const float *bias, void *y, int y_bf16, int64_t N, int64_t K,
                        int64_t Kp, int64_t kv, const int16_t *pk, int64_t m0, int64_t n0,
                        const int P) {
    int64_t sums[PK_M][16] = {{0}};
    packed_tile(xq, Kp, m0, pk, kv, sums, P);
    for (int p = 0; p < P; p++)
        store_channel16(sums[p], xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m0 + p, n0);
}

/* y for M x rows by the per-channel weights' whole blocks of 16 rows (the inputs past the last
 * 32 added by store_channel, the rows past the last block by the tiles). */
static void linear_packed(const int16_t *xq, const float *xs, const int8_t *q,
                          const float *scale, const float *bias, void *y, int y_bf16,
                          int64_t M, int64_t N, int64_t K, int64_t Kp, int num_threads) {
    const int64_t blocks = N / 16, kv = K - K % 32;
#pragma omp parallel num_threads(num_threads)
    {
        int16_t *pk = malloc((size_t)(16 * kv) * sizeof *pk + 64);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * 16;
            pack_pairs(q + n0 * K, K, kv, pk);
            int64_t m0 = 0;
            for (; m0 + PK_M <= M; m0 += PK_M)
                packed_rows(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, pk, m0, n0, PK_M);
            const int P = (int)(M - m0); /* the last tile's rows, a constant in each call */
            if (P == 4)
                packed_rows(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, pk, m0, n0, 4);
            else if (P == 3)
                packed_rows(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, pk, m0, n0, 3);
            else if (P == 2)
                packed_rows(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, pk, m0, n0, 2);
            else if (P == 1)
                packed_rows(xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, pk, m0, n0, 1);
        }
        free(pk);
    }
    for (int64_t n = blocks * 16; n < N; n++)
        rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, 0, M, N, K, Kp, n, 1, 0);
}
#endif

#if HAS_COLUMNS
/* Per-channel int8 with VNNI from COLUMNS_FROM rows: the outputs as lanes, as cpu_linear.c's
 * columns do for bf16. x's int16 rows are packed as pairs of inputs, 16 rows a vector
 * ([kv / 2][rows] 32-bit lanes), each weight row's pair of inputs (sign-extended) is broadcast
 * to every lane, and vpdpwssd adds the pair's two products into one int32 lane an x row. A tile
 * takes Pv vectors (32 to 64 x rows) by R weight rows (Pv * R = 24 accumulators) and reads its
 * weight rows once for all of them, with no horizontal sums; every 16 steps it sign-extends the
 * rows' next 32 inputs into `stage`, one contiguous block (the rows are K apart: read in place,
 * a step's bytes of 12 or 24 rows share an L1 set). A lane holds COLUMNS_CHUNK steps (1024
 * products: 1024 * X16_MAX * 128 < 2^31) before it is added into its output's int64 sum, so the
 * sums are exact and the bits are the tiles' (store_channel). On a 2-core Zen 4 EPYC (VNNI, no
 * AMX; the 1B's 8192x2048 and 2048x8192, bf16 rows, best of 7 in turn): 322-380 GOP/s from 32
 * rows in two runs, 1.02-1.18x the tiles at 32-1024 rows; against dequantize + torch's bf16 GEMM (the path
 * past the tiles' 64 rows) 1.8x at 128 rows, 1.3x at 256, 1.0-1.1x at 512-1024. Below 32 the
 * tiles (16 rows: 0.87-0.98x). */
#define COLUMNS_FROM 32
#define COLUMNS_ACC 24    /* accumulators a tile: Pv * R */
#define COLUMNS_CHUNK 512 /* steps (pairs of inputs) a lane may add before its int64 sum */

/* acc += the pairs of x by b's, a lane at a time (vpdpwssd). In asm: from the intrinsic GCC 12
 * kept each sum in a fresh register and copied it back, and spilled half of the 24 accumulators
 * to the stack (as it did for linear_packed's step). */
INLINE void dpwssd_step(__m512i *acc, __m512i x, __m512i b) {
    __asm__("vpdpwssd %[b], %[x], %[a]" : [a] "+v"(*acc) : [x] "v"(x), [b] "v"(b));
}

/* Outputs n0 .. n0 + R of the x rows m0 .. m0 + P, packed in xp (Pv vectors), stored. The stage
 * asks for no bytes ahead, as cpu_linear.c's columns_tile (here 1.00-1.02x without the row
 * streams' prefetch, which fell on the tile's own rows). Pv and R are constants where inlined. */
INLINE void columns_tile(const uint32_t *xp, const int16_t *xq, const float *xs,
                         const int8_t *q, const float *scale, const float *bias, void *y,
                         int y_bf16, int64_t N, int64_t K, int64_t Kp, int64_t kv, int64_t m0,
                         int P, int64_t n0, const int Pv, const int R) {
    const int lanes = Pv * 16;
    const int64_t pairs = kv / 2; /* whole steps of 16: kv is whole steps of 32 inputs */
    const int8_t *qr = q + n0 * K;
    int64_t sums[COLUMNS_ACC][COLUMNS_VECTORS * 16];
    int32_t stage[COLUMNS_ACC * 16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int l = 0; l < lanes; l++)
            sums[r][l] = 0;
    for (int64_t c0 = 0; c0 < pairs; c0 += COLUMNS_CHUNK) {
        const int64_t c1 = c0 + COLUMNS_CHUNK < pairs ? c0 + COLUMNS_CHUNK : pairs;
        __m512i acc[COLUMNS_VECTORS][COLUMNS_ACC];
#pragma GCC unroll 4
        for (int v = 0; v < Pv; v++)
#pragma GCC unroll 24
            for (int r = 0; r < R; r++)
                acc[v][r] = _mm512_setzero_si512();
        for (int64_t jb = c0; jb < c1; jb += 16) {
#pragma GCC unroll 24
            for (int r = 0; r < R; r++)
                _mm512_store_si512(stage + r * 16, w32_load(qr + r * K + 2 * jb));
            for (int s = 0; s < 16; s++) {
                __m512i xv[COLUMNS_VECTORS];
                for (int v = 0; v < Pv; v++)
                    xv[v] = _mm512_loadu_si512(xp + (jb + s) * lanes + v * 16);
#pragma GCC unroll 24
                for (int r = 0; r < R; r++) {
                    const __m512i b = _mm512_set1_epi32(stage[r * 16 + s]);
                    for (int v = 0; v < Pv; v++) /* in asm: see dpwssd_step */
                        dpwssd_step(&acc[v][r], xv[v], b);
                }
            }
        }
#pragma GCC unroll 4
        for (int v = 0; v < Pv; v++)
#pragma GCC unroll 24
            for (int r = 0; r < R; r++) {
                int64_t *sum = &sums[r][v * 16];
                const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[v][r]));
                const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[v][r], 1));
                _mm512_storeu_si512(sum, _mm512_add_epi64(_mm512_loadu_si512(sum), lo));
                _mm512_storeu_si512(sum + 8, _mm512_add_epi64(_mm512_loadu_si512(sum + 8), hi));
            }
    }
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++)
            store_channel(sums[r][p], xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, m0 + p,
                          n0 + r);
}

/* The tiles of Pv vectors over every weight row: COLUMNS_ACC / Pv rows a tile, shared by the
 * threads; the rows past the last whole tile one at a time. */
#define COLUMNS_PASS(PV)                                                                      \
    {                                                                                         \
        const int64_t tiles = N / (COLUMNS_ACC / (PV));                                       \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                 \
        for (int64_t t = 0; t < tiles; t++)                                                   \
            columns_tile(xp, xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, m0, P,          \
                         t * (COLUMNS_ACC / (PV)), PV, COLUMNS_ACC / (PV));                   \
        for (int64_t n = tiles * (COLUMNS_ACC / (PV)); n < N; n++)                            \
            columns_tile(xp, xq, xs, q, scale, bias, y, y_bf16, N, K, Kp, kv, m0, P, n, PV, 1); \
    }

/* y for the M int16 x rows xq (Kp apart) by per-channel weights, in passes of 2 to
 * COLUMNS_VECTORS vectors of 16 rows (columns_pass_vectors). */
static void linear_columns(const int16_t *xq, const float *xs, const int8_t *q,
                           const float *scale, const float *bias, void *y, int y_bf16,
                           int64_t M, int64_t N, int64_t K, int64_t Kp, int num_threads) {
    const int64_t kv = K - K % 32;
    /* room for the widest pass, whatever the split */
    uint32_t *xp = malloc((size_t)(kv / 2 + 1) * 16 * COLUMNS_VECTORS * sizeof *xp);
    COLUMNS_PASSES(M, columns_pack((const uint16_t *)xq, Kp, kv / 2, m0, P, 16 * Pv, xp))
    free(xp);
}
#undef COLUMNS_PASS
#endif

/* Per-channel scales, or (`grouped`, a constant where inlined) groups of 32. */
INLINE void linear_fixed(const float *x, const int8_t *q, const float *scale, const float *bias,
                        void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                        const int grouped, int kernel, int num_threads) {
    const int64_t Kp = (K + 31) / 32 * 32;
    int16_t *xq = calloc((size_t)(M * Kp), sizeof *xq);
    float *xs = malloc((size_t)M * sizeof *xs);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float a = x[m * K + k] < 0 ? -x[m * K + k] : x[m * K + k];
            amax = a > amax ? a : amax;
        }
        xs[m] = amax > 0 ? amax / X16_MAX : 1.0f;
        const float inv = 1.0f / xs[m];
        for (int64_t k = 0; k < K; k++)
            xq[m * Kp + k] = (int16_t)__builtin_roundf(x[m * K + k] * inv);
    }
#if HAS_AMX_INT8
    if (kernel == KERNEL_AMX)
        linear_amx_int8(xq, xs, q, scale, bias, y, y_bf16, M, N, K, Kp, num_threads);
    else
#endif
#if HAS_PACKED
    if (kernel == KERNEL_PACKED)
        linear_packed(xq, xs, q, scale, bias, y, y_bf16, M, N, K, Kp, num_threads);
    else
#endif
#if HAS_COLUMNS
    if (kernel == KERNEL_COLUMNS)
        linear_columns(xq, xs, q, scale, bias, y, y_bf16, M, N, K, Kp, num_threads);
    else
#endif
        for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
            const int64_t m1 = m0 + CHUNK_ROWS < M ? m0 + CHUNK_ROWS : M, full = N / ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
            for (int64_t b = 0; b < full; b++)
                rows_block_fixed_of(xq, xs, q, scale, bias, y, y_bf16, m0, m1, N, K, Kp,
                                    b * ROWS, grouped);
            for (int64_t n = full * ROWS; n < N; n++)
                rows_block_fixed(xq, xs, q, scale, bias, y, y_bf16, m0, m1, N, K, Kp, n, 1,
                                 grouped);
        }
    free(xq);
    free(xs);
}
#endif

/* linear_int8's `path`: the build's fastest (0), or forced to the portable path, or for
 * per-channel scales to the fixed-point tiles where the build would take AMX's tiles, the
 * packed GEMM or the columns (for tests). */
enum { PATH_BEST, PATH_PORTABLE, PATH_TILES };

/* Which kernel linear_int8 runs for M rows (at most CALL_ROWS: more go a chunk at a time, each
 * asked apart) by weights with a scale per G of their K inputs, on `path`: AMX's int8 tiles,
 * the packed GEMM, the columns or the path's own tiles (the same bits per channel: the tests
 * ask this). */
int linear_int8_kernel(int64_t M, int64_t K, int64_t G, int path) {
    if (path != PATH_BEST || G != K)
        return KERNEL_TILES;
#if HAS_AMX_INT8
    if (M >= AMXQ_FROM && amx_permitted())
        return KERNEL_AMX;
#endif
#if HAS_PACKED
    if (M >= PACKED_FROM)
        return KERNEL_PACKED;
#endif
#if HAS_COLUMNS
    if (M >= COLUMNS_FROM)
        return KERNEL_COLUMNS;
#endif
    (void)M;
    return KERNEL_TILES;
}

void linear_int8(const void *x, int x_bf16, const int8_t *q, const float *scale,
                 const float *bias, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                 int64_t G, int path, int num_threads) {
    if (M > CALL_ROWS) { /* each row's result is its own: the same bits a chunk at a time */
        for (int64_t m0 = 0; m0 < M; m0 += CALL_ROWS)
            linear_int8((const char *)x + m0 * K * (x_bf16 ? 2 : 4), x_bf16, q, scale, bias,
                        (char *)y + m0 * N * (y_bf16 ? 2 : 4), y_bf16,
                        M - m0 < CALL_ROWS ? M - m0 : CALL_ROWS, N, K, G, path, num_threads);
        return;
    }
    const int portable = path == PATH_PORTABLE;
    float *widened = NULL;
    const float *xf = x;
    if (x_bf16) {
        widened = malloc((size_t)(M * K) * sizeof *widened);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= PARALLEL_ROWS)
        for (int64_t i = 0; i < M * K; i++)
            widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = widened;
    }
#if HAS_FIXED
    if (!portable && G == K)
        linear_fixed(xf, q, scale, bias, y, y_bf16, M, N, K, 0,
                     linear_int8_kernel(M, K, G, path), num_threads);
    else if (!portable && G == 32)
        linear_fixed(xf, q, scale, bias, y, y_bf16, M, N, K, 1, KERNEL_TILES, num_threads);
    else
#endif
    /* Q8_0's groups of 32 with G a constant: each group's loop unrolled (as a variable, the
     * per-group bookkeeping cost more than the group's loads) */
    if (HAS_AVX512 && !portable && G == 32)
        linear_rows(xf, q, scale, bias, y, y_bf16, M, N, K, 32, 1, num_threads);
    else if (HAS_AVX512 && !portable)
        linear_rows(xf, q, scale, bias, y, y_bf16, M, N, K, G, 1, num_threads);
    else if (G == 32)
        linear_rows(xf, q, scale, bias, y, y_bf16, M, N, K, 32, 0, num_threads);
    else
        linear_rows(xf, q, scale, bias, y, y_bf16, M, N, K, G, 0, num_threads);
    free(widened);
}

/* Whether this build has the AVX-512 path (kernels.native reports it; the tests force the
 * other). */
int linear_int8_has_avx512(void) { return HAS_AVX512; }

/* Whether per-channel int8 weights and groups of 32 take the fixed-point path (x as int16) in
 * this build, and whether it runs on VNNI. */
int linear_int8_has_fixed(void) { return HAS_FIXED; }
int linear_int8_has_vnni(void) { return HAS_VNNI; }

/* Whether per-channel int8 weights take the packed GEMM (linear_packed) in this build. */
int linear_int8_has_packed(void) { return HAS_PACKED; }

/* Whether per-channel int8 weights take the columns (linear_columns) in this build. */
int linear_int8_has_columns(void) { return HAS_COLUMNS; }

/* Whether per-channel int8 weights take AMX's int8 tiles in this build and process. */
int linear_int8_has_amx(void) {
#if HAS_AMX_INT8
    return amx_permitted();
#else
    return 0;
#endif
}
