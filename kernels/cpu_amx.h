/* AMX's tile registers, for the kernels that use them (cpu_linear.c's bf16 tiles, cpu_int8.c's
 * int8 ones; a header apart: the system headers it needs clash with names in the other
 * kernels). Part of each build's cache key. */
#ifndef KVBATCH_CPU_AMX_H
#define KVBATCH_CPU_AMX_H

#include <stdint.h>
#include <string.h>

/* Their configuration (palette 1: 8 tiles of up to 16 rows by 64 bytes), and whether this
 * process may use them (Linux grants them on request, 5.16 on). */
#ifdef __AMX_TILE__
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Loads palette 1 with tile t as 16 rows of colsb[t] bytes (0: unconfigured). */
static inline void amx_tile_config(const int colsb[8]) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++)
        if (colsb[t]) {
            c.rows[t] = 16;
            c.colsb[t] = (uint16_t)colsb[t];
        }
    _tile_loadconfig(&c);
}

static inline int amx_permitted(void) {
    static int permitted = -1; /* every caller computes the same: a benign race */
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}
#endif

#endif
