/* AVX2 helpers shared by cpu_linear.c's and cpu_int8.c's packed GEMMs (apart from
 * cpu_common.h: immintrin.h declares names, such as select, that other kernels define). */
#ifndef KVBATCH_CPU_AVX2_H
#define KVBATCH_CPU_AVX2_H

#ifdef __AVX2__
#include <immintrin.h>

#include "cpu_common.h"

/* 8 vectors of 8 int32 (rows) transposed in place: r[j] lane i becomes r[i] lane j. */
INLINE void transpose8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 0-3, then 4-7 */
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}
#endif

#endif
