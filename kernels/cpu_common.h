/* Shared by the CPU kernels (kernels/cpu_*.c); part of each build's cache key. */
#ifndef KVBATCH_CPU_COMMON_H
#define KVBATCH_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* Floats per vector, one register's worth: 16 with AVX-512, else 8. GCC splits wider vectors
 * over registers for elementwise work but assembles their shuffles, compares and selects lane
 * by lane (with 16 on AVX2 the kernels ran at half speed or worse). */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned loads */
typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef _Float16 vhf_u __attribute__((vector_size(VL * 2), aligned(2)));

/* Keeps vector v (or a and b) in a register where it is used several times (gcc 12 loaded it
 * again for each use: see cpu_linear.c's tiles). Only where one register holds VL floats (AVX,
 * AVX-512): without AVX (x86's baseline, a portable build) the constraint is impossible, and
 * there it is nothing. */
#if defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#define IN_REGISTERS(a, b) __asm__("" : "+v"(a), "+v"(b))
#else
#define IN_REGISTER(v) ((void)0)
#define IN_REGISTERS(a, b) ((void)0)
#endif

/* A lone stream of weights (one x row, one weight row after another) asks for the bytes
 * STREAM_AHEAD past the ones it reads into L2 (prefetcht1; prefetches never fault, so past the
 * matrix's end is harmless). The hardware prefetcher alone left a 2-core Xeon with AMX at
 * 25 GB/s on such a stream, against 38 GB/s with this at 4-16 KiB ahead. */
#define STREAM_AHEAD 8192
INLINE void prefetch_stream(const void *p) {
    __builtin_prefetch((const char *)p + STREAM_AHEAD, 0, 2);
}

/* The columns kernels (cpu_linear.c's for bf16, cpu_int8.c's for int8): x rows of 16-bit
 * values (`stride` apart) m0 .. m0 + P as pairs of inputs 0 .. 2 * pairs, `lanes` a step (16
 * rows a vector): xp[j * lanes + l] = x[m0 + l][2j .. 2j + 1], zero for the lanes past P. */
INLINE void columns_pack(const uint16_t *x, int64_t stride, int64_t pairs, int64_t m0, int P,
                         int lanes, uint32_t *xp) {
    for (int l = 0; l < lanes; l++)
        for (int64_t j = 0; j < pairs; j++) {
            uint32_t pair = 0;
            if (l < P)
                memcpy(&pair, x + (m0 + l) * stride + 2 * j, sizeof pair);
            xp[j * lanes + l] = pair;
        }
}

/* The columns take M rows in passes of at most COLUMNS_VECTORS vectors of 16 rows, the vectors
 * spread evenly over the passes (the first ones one more where they do not divide): the x
 * vectors of pass i. From 32 rows every pass has 2 vectors or more (160 rows: 64, 48, 48). */
#define COLUMNS_VECTORS 4
INLINE int64_t columns_pass_vectors(int64_t M, int64_t i) {
    const int64_t vectors = (M + 15) / 16;
    const int64_t passes = (vectors + COLUMNS_VECTORS - 1) / COLUMNS_VECTORS;
    return vectors / passes + (i < vectors % passes);
}

/* The columns' passes over M rows (M at least 32: every pass 2 to 4 vectors): for each, its
 * first row m0 and rows P, PACK (a statement: pack those rows, 16 * Pv lanes) and then the
 * including file's COLUMNS_PASS(Pv), which runs the pass's tiles. */
#define COLUMNS_PASSES(M, PACK)                                                               \
    for (int64_t i = 0, m0 = 0; m0 < (M); i++) {                                              \
        const int64_t rows = 16 * columns_pass_vectors((M), i);                               \
        const int P = (int)((M) - m0 < rows ? (M) - m0 : rows);                               \
        const int Pv = (P + 15) / 16;                                                         \
        PACK;                                                                                 \
        switch (Pv) {                                                                         \
        case 2: COLUMNS_PASS(2) break;                                                        \
        case 3: COLUMNS_PASS(3) break;                                                        \
        default: COLUMNS_PASS(4) break;                                                       \
        }                                                                                     \
        m0 += P;                                                                              \
    }

/* A bf16 value as float32 (exact: a shift). */
INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bf16 bits, round to nearest even (NaN stays NaN), as torch rounds; branch-free
 * so that the loops calling it vectorise. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* Output element i of a linear: s plus bias[n] when there is a bias, as bf16 or float32. */
INLINE void store_out(void *y, int y_bf16, int64_t i, float s, const float *bias, int64_t n) {
    s = bias ? s + bias[n] : s;
    if (y_bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(s);
    else
        ((float *)y)[i] = s;
}

/* VL bf16 values from p on, as float32 (exact: a shift). */
INLINE vf load_bf16(const void *p) {
    const vu bits = __builtin_convertvector(*(const vh_u *)p, vu) << 16;
    vf v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* VL fp16 values from p on, as float32 (exact). */
INLINE vf load_f16(const void *p) { return __builtin_convertvector(*(const vhf_u *)p, vf); }

/* exp(x), vectorisable (Cephes' polynomial, about 1 ulp): 0 below -87, x clamped at 88. */
INLINE float exp_approx(float x) {
    const float lo = -87.0f, hi = 88.0f;
    const float clamped = x < lo ? lo : (x > hi ? hi : x);
    const float k = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round */
    float r = clamped - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lo ? 0.0f : y * scale;
}

#endif
