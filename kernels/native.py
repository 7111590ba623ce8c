"""Native CPU kernels: C sources next to this file, compiled once per CPU and loaded by ctypes.

The CPU path needs a C compiler (``cc``/``gcc``, or ``$CC``), as torch's inductor does. Each
source is built with ``-O3 -march=native -fno-trapping-math -fopenmp`` (plus its own flags) into
``$KVBATCH_CACHE_DIR/kernels/`` (default ``~/.cache/kvbatch``), named by a hash of the source,
the flags, the compiler and the CPU's feature flags, so that a cache shared between different
machines never loads code built for another instruction set (the shared headers,
``cpu_common.h``, ``cpu_amx.h`` and ``cpu_avx2.h``, are part of every key). OpenMP resolves to the
``libgomp.so.1`` that torch has already loaded, so the kernels and torch share one thread pool
runtime. ctypes releases the GIL for the duration of a call. ``bench/profile.py`` names the
C functions in its profiles (``labelled_for_profiler``).

- ``cpu_decode.c``: paged decode attention (``paged_decode``) and the cache write
  (``reshape_and_cache``).
- ``cpu_layer.c``: a decoder layer's fused elementwise ops (``rms_norm``, ``head_norms_``,
  ``rotary_``, ``silu_mul``), rounding where transformers' eager ops round, built without FMA
  contraction; and the row ``argmax`` of greedy sampling.
- ``cpu_linear.c``: linear layers over a few rows (``linear``: decode steps), reading the
  weights once, bf16 ones widened as they are read (or multiplied as bf16 pairs with
  AVX512-BF16, when x is bf16 too); and LoRA adapters' products (``lora_add_``, over a
  projection's ``LoRATable``).
- ``cpu_int8.c``: weight-only int8 linear layers (``linear_int8``): int8 weights with a float32
  scale per group of inputs (a fixed-point path, VNNI's or AVX2's, for scales per channel and
  per 32, per channel on AMX's int8 tiles where the CPU has them, the same bits; an AVX-512
  path and a portable one widening the weights to float32 in registers).
- ``cpu_step.c``: a decode step's decoder layers in one call (``DecodeLayers``), chaining the
  kernels above as the layer-by-layer path does, with none of Python's per-op costs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

# -fno-trapping-math (values unchanged; torch builds with it too) lets GCC turn the branches of
# exp's clamps into selects: without AVX-512's masks, the loops calling exp would not vectorise.
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # as the C files number them
CACHE_ENV = "KVBATCH_CACHE_DIR"

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p
# source stem -> (extra compiler flags, {function: argtypes})
LIBRARIES: dict[str, tuple[tuple[str, ...], dict[str, list]]] = {
    "cpu_decode": ((), {
        "paged_decode": [_ptr, _ptr, _ptr, _i32, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                         _i64, _f32, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i32],
        "reshape_and_cache": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    }),
    "cpu_layer": (("-ffp-contract=off",), {
        "rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _i32, _i32],
        "rotary": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32, _i32],
        "head_norms": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32, _i32, _i32],
        "silu_mul": [_ptr, _ptr, _i64, _i64, _i32, _i32],
        "argmax_rows": [_ptr, _ptr, _i64, _i64, _i32, _i32],
        "mask_rows": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i32],
    }),
    # No contraction into FMAs: gcc 13 fused the tile shapes' multiply-adds differently, and a
    # row's float32 result then depended on the rows beside it (seen on an H200 machine's Xeon),
    # which the batch-invariant mode rules out. No slower here: the kernel waits on memory.
    "cpu_linear": (("-ffp-contract=off",), {
        "linear_small": [_ptr, _i32, _ptr, _i32, _ptr, _ptr, _i32, _i64, _i64, _i64, _i32],
        "linear_fixed": [_ptr, _i32, _ptr, _i32, _ptr, _ptr, _i32, _i64, _i64, _i64, _i32],
        "linear_pack_dot": [_ptr, _i64, _i64, _i32],
        "lora_add": [_ptr, _ptr, _i32, _ptr, _ptr, _i64, _i64, _i64, _i32],
    }),
    # The same for the int8 linear: on an AVX2 host gcc 12 contracted its tile shapes apart.
    # Measured there, one thread, 8192x2048: 1 row unchanged (7.4-7.9 ms either way), 4 rows
    # 8.5-8.9 ms contracted against 9.2-9.7 ms not.
    "cpu_int8": (("-ffp-contract=off",), {
        "linear_int8": [_ptr, _i32, _ptr, _ptr, _ptr, _ptr, _i32, _i64, _i64, _i64, _i64, _i32,
                        _i32],
    }),
    "cpu_step": ((), {
        "decode_layers": [_ptr, _ptr, _i64, _ptr, _ptr, _i32, _i64, _i64, _i64, _i64, _i64,
                          _i64, _f32, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                          _i64, _f32, _i64, _i32, _ptr, _ptr, _i32],
    }),
}
# The kernels cpu_step.c chains, in the order of its ``struct kernels``.
STEP_KERNELS = (("cpu_layer", "rms_norm"), ("cpu_linear", "linear_small"),
                ("cpu_layer", "rotary"), ("cpu_layer", "silu_mul"),
                ("cpu_decode", "reshape_and_cache"), ("cpu_decode", "paged_decode"),
                ("cpu_int8", "linear_int8"), ("cpu_layer", "head_norms"),
                ("cpu_linear", "lora_add"))
# Rows up to which ``linear`` runs the C kernel, by weight dtype (see ``linear_max_rows``); past
# them torch's GEMM wins (float32 weights as they are, bf16 widened first where the CPU has no bf16
# arithmetic). Measured on a 2-core AVX2 host: at 8 rows the kernel took 32-38 ms a step of
# SmolLM2's linears in float32 against torch's 60-72 ms. With bf16 weights, on a 2-core AVX2 EPYC
# (2026-12-04), 8 rows against chunked widen-then-GEMM: 0.40 vs 0.80 ms for SmolLM2's 1536x576, 6.9
# vs 17.5 ms for Llama-3.2-1B's 8192x2048; at 32 rows they tie. On a 2-core Xeon with AVX512-BF16,
# whose dot product of bf16 pairs the kernel then uses: 22.9 ms at 8 rows against torch's bf16
# GEMM's 23.6 (and 38.2 against 23.7 at 16), and a decode step of 8 rows in one C call 31 ms against
# 39 layer by layer. With its weight vectors kept in registers (2026-12-06, a 2-core Zen 4 EPYC,
# Llama-3.2-1B's decode steps, bench/decode_rows.py) the one call won to 32 rows: 96.3 against 166.1
# ms at 8, 142.3 against 217.2 at 16, 277.9 against 320.6 at 32; it tied at 40 (357.2 against 357.3)
# and lost at 48. With the dot tiles back in the shared OpenMP body (the same CPU model, later that
# day, --one-call-rows 128, two runs) it won to 80 rows: 247.1 against 293.7 at 32, 295.6-302.9
# against 346.9-362.0 at 40, 351.8-361.1 against 412.1-418.0 at 48, 384.7-394.2 against 412.8-435.7
# at 64, 494.4 against 521.7 at 80; it tied at 96 (618.2 against 621.6) and lost at 128 (687.4
# against 664.5). With 32 rows and more on the columns (cpu_linear.c's linear_columns; the same
# CPU model, 2026-12-07, --one-call-rows 128 and 256): 241.6 against 332.8 ms at 32, 396.8
# against 484.2 at 64, 489.3 against 644.1 at 80, 588.2-621.2 against 655.2-669.9 at 96; a tie
# from 128 (671.5-699.3 against 668.7-728.2; 822.8 against 839.2 at 192). The limit is 96.
# Where torch's bf16 GEMM runs on AMX tiles (a 2-core Xeon with
# AMX, 2026-12-05, Llama-3.2-1B's decode steps, bench/decode_rows.py): the one C call with the dot
# product won to 4 rows (84.7 against 110.5 ms), tied at 6 (112.7 against 112.4) and lost at 8
# (130.3 against 112.7). The kernel on AMX's tiles itself (one pass over the weights for up to 32
# rows) won at every row count to 32: 83.0 against 114.0 ms at 8 rows, 94.8 against 119.0 at 16,
# 126.1 against 133.5 at 32.
# Widened bf16 past 8 rows (a 2-core AVX2 Zen 3 EPYC, 2026-12-06, Llama-3.2-1B's decode steps,
# bench/decode_rows.py --one-call-rows 32): the one call won to 24 rows, 345.2 against 657.2 ms
# at 12 (torch's float32 GEMM is slow at so few rows), 432.7 against 481.1 at 16, 634.1 against
# 690.2 at 24, and lost at 32 (802.2 against 765.2). With each kind's tiles specialised and
# x's rows padded for torch's GEMM (GEMM_ROW_ALIGN; the same CPU, later that day): 537.9 against
# 800.1 ms at 20, 630.1 against 765.3 at 24, 866.5 against 803.1 at 28, 1035.0 against 857.9 at
# 31 (unpadded, torch's GEMM took 1367.0 ms at 31 rows, and the kernel won to 31): the two
# meet between 24 and 28, so the limit stays 24.
LINEAR_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 24}
# float32 weights where the kernel is built 8 floats a vector (AVX2, and the portable build;
# measured on a 2-core AVX2 Zen 3 EPYC, 2026-12-06, bench/decode_rows.py --dtype float32
# --one-call-rows 40): the one call won at every row count to 32 and past it, SmolLM2 (the
# default model, float32 the default dtype on such CPUs) 67.7 against 120.1 ms a step at 16 rows
# and 125.7 against 145.9 at 32, Llama-3.2-1B 948.3 against 1396.6 at 32 and 1261.0 against
# 1512.8 at 40. With AVX-512 (a 2-core Zen 4 EPYC, 2026-12-06, --dtype float32, each kind's
# tiles compiled apart), to 64 rows (LINEAR_MAX_ROWS): SmolLM2 26.7 against 75.3 ms a step at 8
# rows, 84.1 against 113.7 at 32, 140.4 against 151.5 at 64, 213.0 against 206.6 at 96; the 1B
# 292.7 against 800.1 at 16, 602.5 against 1120.1 at 32, 919.3 against 1294.9 at 64. Not measured
# on a Xeon.
LINEAR_MAX_ROWS_FLOAT32_AVX2 = 32
# A row limit no step reaches: AVX2's packed GEMM takes every row count.
EVERY_ROW_COUNT = 1 << 62
# float32 and bf16 weights where the kernel has AVX2's packed GEMM (cpu_linear.c's linear_packed,
# from 24 rows; a 2-core AVX2 Zen 3 EPYC, 2026-12-07, the 1B's four matrices, 2 threads, against
# torch's GEMM as ``linear`` ran it past the old limits): bf16 1.2-1.7x at 24-128 rows, 1.30x at
# 512, 1.07x at a prefill's 1,574; float32 (against F.linear) 1.4-2.1x at 24-128, 1.07x at 512.
# It won at every row count, so it takes them all.
LINEAR_MAX_ROWS_PACKED = EVERY_ROW_COUNT
# float32 and bf16 weights where the kernel has AVX-512's packed GEMM (AVX-512 without AVX512-BF16:
# Skylake-SP, Cascade Lake and Ice Lake Xeons; 32 weight rows a block, 12 x rows a tile). On a
# 2-core Xeon without AVX512-BF16 or AMX (2026-12-07, 2 threads), the 1B's 8192x2048 against torch's
# GEMM as ``linear`` ran it past the old limits: float32 1.17-1.31x at 24-48 rows, 1.08x at 64,
# 1.04x at 96, 0.98x at 128, 0.86x at 256; bf16 widened 1.26-1.71x at 24-128 rows, 1.05x at 192,
# 1.00x at 256, 0.98x at 512; against the tiles (the old kernel, to 64 and 24 rows) 1.2-1.9x from 24
# rows. Whole decode steps (bench/decode_rows.py, one C call against layer by layer): the 1B in bf16
# 1.81x at 24 rows, 1.51x at 32, 1.40x at 64, 1.21x at 128, 1.05x at 192, 1.08x at 256; SmolLM2 in
# float32 (this CPU's default dtype) 1.19-1.20x at 32, 1.15-1.22x at 64, 1.04-1.05x at 96,
# 1.07-1.08x at 128, 1.04x at 192. With the tiles the same SmolLM2 steps had tied torch at 32 rows
# and lost at 64 (0.83-0.84x), where the old limit still sent them.
LINEAR_MAX_ROWS_PACKED_AVX512 = {torch.float32: 128, torch.bfloat16: 256}
LINEAR_MAX_ROWS_BF16_DOT = 96
LINEAR_MAX_ROWS_BF16_TORCH_AMX = 5
LINEAR_MAX_ROWS_BF16_AMX = 32


def cache_dir() -> Path:
    """kvbatch's cache (``$KVBATCH_CACHE_DIR`` or ``~/.cache/kvbatch``): built kernels under
    ``kernels/``, the engine's converted models under ``models/``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvbatch")


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor() or platform.machine()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("the CPU kernels need a C compiler (cc/gcc, or set CC)")
    return cc


@cache
def library(name: str, sources: Path | None = None, march: str = "native") -> ctypes.CDLL:
    """The compiled kernels of ``kernels/<name>.c``, built on first use for this CPU (or for
    ``-march=<march>``); or of ``<name>.c`` in ``sources`` with its headers (another
    revision's, for ``bench/kernel_ab.py``)."""
    extra, functions = LIBRARIES[name]
    source = (sources or Path(__file__).parent) / f"{name}.c"
    flags = (*CFLAGS, f"-march={march}", *extra)
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # cpu_common.h, cpu_amx.h
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, *flags, version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run(
                [cc, *flags, str(source), "-o", str(built), "-lm"],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"building {source.name} failed:\n{proc.stderr}")
            built.replace(target)  # atomic: concurrent builders each publish a whole file
    lib = ctypes.CDLL(str(target))
    for function, argtypes in functions.items():
        if sources is not None and not hasattr(lib, function):
            continue  # another revision's build, from before the function
        getattr(lib, function).restype = None
        getattr(lib, function).argtypes = argtypes
    return lib


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@cache
def linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows of a ``dtype`` weight ``linear`` runs in the C kernel (0: none):
    ``LINEAR_MAX_ROWS``, or for bf16 ``LINEAR_MAX_ROWS_BF16_DOT`` where the kernel was built
    with AVX512-BF16's dot product (asked of the built library, not of the CPU, so the two
    cannot disagree); ``LINEAR_MAX_ROWS_BF16_AMX`` where the kernel runs on AMX's tiles
    (built with them, and granted them by the OS), ``LINEAR_MAX_ROWS_BF16_TORCH_AMX`` where
    only torch's bf16 GEMM does (:func:`cpu_has_amx`); for float32
    ``LINEAR_MAX_ROWS_FLOAT32_AVX2`` where the kernel was built 8 floats a vector; for both,
    ``LINEAR_MAX_ROWS_PACKED`` (every row count) where it has AVX2's packed GEMM, and
    ``LINEAR_MAX_ROWS_PACKED_AVX512`` where it has AVX-512's."""
    lib = library("cpu_linear")
    if dtype in LINEAR_MAX_ROWS and lib.linear_packed_from():
        if lib.linear_vector_floats() == 8:
            return LINEAR_MAX_ROWS_PACKED
        return LINEAR_MAX_ROWS_PACKED_AVX512[dtype]
    if dtype == torch.float32 and lib.linear_vector_floats() == 8:
        return LINEAR_MAX_ROWS_FLOAT32_AVX2
    if dtype == torch.bfloat16 and lib.linear_has_bf16_dot():
        if lib.linear_has_amx():
            return LINEAR_MAX_ROWS_BF16_AMX
        return LINEAR_MAX_ROWS_BF16_TORCH_AMX if cpu_has_amx() else LINEAR_MAX_ROWS_BF16_DOT
    return LINEAR_MAX_ROWS.get(dtype, 0)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles, which torch's bf16 GEMM (oneDNN) runs on."""
    return "amx_bf16" in _cpu_flags().split()


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the CPU, in ``x``'s dtype, accumulated in float32.

    Up to ``linear_max_rows(weight.dtype)`` rows of ``x`` ([M, K], float32 or bf16) go through
    the C kernel, which reads a float32 or bf16 ``weight`` ([N, K]) once (every row count
    where it has AVX2's packed GEMM; 128 and 256 where it has AVX-512's). More rows go to
    torch's GEMM, in float32 when the weight is bf16 and the CPU has no bf16 arithmetic (widened
    first: exact, and still far faster than torch's bf16 GEMM there). A weight packed by
    :func:`pack_bf16` takes the C kernel at every row count, bf16 rows of any leading shape.
    """
    if is_packed(weight) or (x.dim() == 2 and x.shape[0] <= linear_max_rows(weight.dtype)
                             and x.dtype in LINEAR_MAX_ROWS):
        return _linear_c("linear_small", x, weight, bias)
    if weight.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return _linear_widened(x, weight, bias)
    return F.linear(x, weight, bias)


# Bytes of weight rows made at a time by ``_linear_chunked`` (bf16 widened, int8 dequantized).
WIDEN_CHUNK_BYTES = 8 << 20
# ``_linear_chunked`` multiplies x's rows padded to a multiple of this where it makes y
# transposed (below ``CHUNKED_X_FIRST_FROM`` rows, or chunks not float32). torch's float32 GEMM
# (MKL) of a weight chunk by x transposed is slow at row counts off a multiple of 8: on a 2-core
# AVX2 Zen 3 EPYC, Llama-3.2-1B's 16384x2048 widened took 39.9 ms at 31 rows against 21.9 at
# 32, 41.7 at 47 against 25.0 at 48, 81.2 at 127 against 62.7 at 128.
GEMM_ROW_ALIGN = 8
# From this many rows ``_linear_chunked`` makes y's columns a float32 weight chunk at a time,
# ``x @ chunk.T`` (F.linear's own layout) into a block the call's chunks share, instead of y
# transposed a chunk's rows at a time. On a 2-core Xeon without AVX512-BF16 (2026-12-07), the
# 1B's 8192x2048 widened on one thread: 107-141 GFLOP/s against 91-128 at 127-1,601 rows
# (float32 weights in F.linear: 121-148), but 54-58 against 70-71 at 31-32 rows (128 is a
# cautious limit: 33-126 rows were not measured); on both cores 1.03-1.04x at 128-257 rows,
# 1.14-1.16x at 512-1,024, 1.40x at a prefill's 1,601; the 1B's 32-request round (bf16,
# bench/realsize.py) 36.6 useful tok/s against 32.7, 2.80x transformers against 2.62x.
CHUNKED_X_FIRST_FROM = 128
_scratch = threading.local()


def _chunk_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The thread's reused buffer of at least ``numel`` ``dtype`` elements."""
    buffers: dict[torch.dtype, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: inside inference mode or not
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf


def _linear_chunked(x: torch.Tensor, n: int, dtype: torch.dtype,
                    weight_rows: Callable[[torch.Tensor, int], object],
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of ``x`` by an ``[n, K]`` weight in ``dtype`` that is never whole in memory:
    ``weight_rows(chunk, n0)`` writes its rows ``n0 : n0 + len(chunk)`` into ``chunk``,
    ``WIDEN_CHUNK_BYTES`` at a time, in one buffer reused by every call of the thread.

    Making a whole real-size matrix in a fresh tensor page-faults its every byte: widening
    Llama-3.2-1B's 8192x2048 bf16 up-projection took 43 ms of the 70 a 32-row product took on
    a 2-core AVX2 host (17 ms chunked). The result is in ``x``'s dtype. From
    ``CHUNKED_X_FIRST_FROM`` rows, where the chunks are float32, y is made a chunk's columns
    at a time (``x @ chunk.T``); else y transposed, a chunk's rows at a time.
    """
    k = x.shape[-1]
    step = max(1, min(n, WIDEN_CHUNK_BYTES // (dtype.itemsize * k)))
    buf = _chunk_buffer(step * k, dtype)
    rows = x.numel() // k
    xr = x.reshape(rows, k).to(dtype)
    columns = dtype == torch.float32 and rows >= CHUNKED_X_FIRST_FROM
    if columns:  # y itself, through a block the call's chunks share
        y = torch.empty(rows, n, dtype=dtype)
        block = torch.empty(rows * step, dtype=dtype)
    else:
        # x's rows padded with zeros to a multiple of GEMM_ROW_ALIGN: the padding rows' outputs
        # are dropped, and the others' sums are unchanged
        xt = F.pad(xr, (0, 0, 0, -rows % GEMM_ROW_ALIGN)).T
        out_t = torch.empty(n, xt.shape[1], dtype=dtype)  # y transposed, filled by rows
        y = out_t[:, :rows].T
    for n0 in range(0, n, step):
        chunk = buf[: min(step, n - n0) * k].view(-1, k)
        weight_rows(chunk, n0)
        c = chunk.shape[0]
        if columns:
            part = block[: rows * c].view(rows, c)
            torch.mm(xr, chunk.T, out=part)
            y[:, n0 : n0 + c] = part
        else:
            torch.mm(chunk, xt, out=out_t[n0 : n0 + c])
    if bias is not None:
        y += bias.to(dtype)
    return y.to(x.dtype).contiguous().view(*x.shape[:-1], n)


def _linear_widened(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 ``weight`` in float32, widened a chunk of rows at a time."""
    return _linear_chunked(x, weight.shape[0], torch.float32,
                           lambda chunk, n0: chunk.copy_(weight[n0 : n0 + chunk.shape[0]]), bias)


def linear_rows(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the C kernel whatever the rows of ``x`` ([M, K],
    float32 or bf16; ``weight`` [N, K] float32 or bf16), in ``x``'s dtype.

    Each output is reduced in one order fixed by ``K`` alone (``cpu_linear.c``'s
    ``linear_fixed``: its tiles at every row count, never the columns ``linear`` takes for
    many bf16 rows; a packed weight's kernel, :func:`pack_bf16`, has one order anyway): a row's
    result does not depend on ``M`` nor on the other rows, which ``kernels.batch_invariant``
    relies on.
    """
    return _linear_c("linear_fixed", x, weight, bias)


def _linear_c(function: str, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through ``cpu_linear.c``'s ``linear_small`` or ``linear_fixed`` (x's
    leading dimensions kept where the weight is packed)."""
    packed = is_packed(weight)
    if packed and x.dtype != torch.bfloat16:
        raise TypeError(f"bf16 weights packed for the dot product take bf16 rows, not {x.dtype}")
    if x.dtype not in LINEAR_MAX_ROWS or not (packed or weight.dtype in LINEAR_MAX_ROWS):
        raise TypeError(f"no C linear for {x.dtype} rows by {weight.dtype} weights")
    n, k = logical_shape(weight)
    if x.shape[-1] != k:
        raise ValueError(f"rows of {x.shape[-1]} inputs by a weight of {k}")
    lead = x.shape[:-1]
    weight, x = weight.contiguous(), x.reshape(-1, k).contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    out = x.new_empty(x.shape[0], n)
    getattr(library("cpu_linear"), function)(
        x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(),
        2 if packed else int(weight.dtype == torch.bfloat16),
        None if bf is None else bf.data_ptr(), out.data_ptr(), int(out.dtype == torch.bfloat16),
        x.shape[0], n, k, torch.get_num_threads(),
    )
    return out.view(*lead, n)


# Weight rows a block of bf16 weights packed for the dot product holds (cpu_linear.c's PDOT_ROWS)
PACKED_BLOCK = 32
# Rows up to which a decode step on packed weights runs its layers in one C call (DecodeLayers):
# its linear is the same kernel either way, so only the per-op costs differ. On a 2-core Zen 4
# EPYC (2026-12-07, the 1B, bench/decode_rows.py --against layers --one-call-rows 192) the one
# call ran 1.03x layer by layer at 96 rows, 1.06x at 128 and at 192 (0.97x at 64: noise; bf16
# takes it to 96 there anyway).
LINEAR_MAX_ROWS_PACKED_DOT = 192


def packs_bf16() -> bool:
    """Whether a model's bf16 projections and lm_head are packed for the dot product at load
    here (:func:`pack_bf16`): where the C linear has AVX512-BF16's dot product and neither it nor
    torch's GEMM has AMX's tiles (which take a step's many rows faster than any vector kernel)."""
    lib = library("cpu_linear")
    return bool(lib.linear_has_bf16_dot()) and not lib.linear_has_amx() and not cpu_has_amx()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU bf16 ``[N, K]`` weight packed in place as ``cpu_linear.c``'s
    ``linear_packed_dot`` reads it, and returned as that: int32 ``[N / 32, K / 2, 32]`` over the
    same memory, each element a pair of inputs of one row, a block of 32 rows a pair at a time
    (``weight`` itself no longer reads as rows). :func:`linear` and :func:`linear_rows` take it
    for every row count."""
    if not packable(weight):
        raise ValueError(f"packing takes a contiguous CPU bf16 weight (packed in place) of rows "
                         f"a multiple of {PACKED_BLOCK} and an even number of inputs, not "
                         f"{weight.dtype} {list(weight.shape)} on {weight.device.type}"
                         f"{'' if weight.is_contiguous() else ', not contiguous'}")
    n, k = weight.shape
    library("cpu_linear").linear_pack_dot(weight.data_ptr(), n, k, torch.get_num_threads())
    return weight.view(torch.int32).view(n // PACKED_BLOCK, k // 2, PACKED_BLOCK)


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_bf16` takes ``weight``: a contiguous CPU bf16 ``[N, K]``, N whole
    blocks, K pairs (at least one)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[0] % PACKED_BLOCK == 0 and weight.shape[1] % 2 == 0
            and weight.shape[1] > 0)


def packed_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` ([T] indices) of the bf16 weight :func:`pack_bf16` packed, as [T, K]
    bf16: an embedding lookup in a table packed for the tied lm_head. Row ``n`` is lane
    ``n % 32`` of block ``n // 32``, a pair of inputs (the even one low) a 32-bit word: a
    gather of one word every 128 bytes, a few rows a step."""
    rows = rows.long()
    return packed[rows // PACKED_BLOCK, :, rows % PACKED_BLOCK].view(torch.bfloat16)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` bf16 weight :func:`pack_bf16` packed."""
    n, k = packed_shape(packed)
    rows = torch.empty(n // PACKED_BLOCK, PACKED_BLOCK, k // 2, dtype=torch.int32)
    rows.copy_(packed.transpose(1, 2))  # a fresh tensor's strides, whatever dims are 1
    return rows.view(n, k // 2).view(torch.bfloat16)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a bf16 weight packed by :func:`pack_bf16`."""
    return weight.dtype == torch.int32 and weight.dim() == 3 and weight.shape[2] == PACKED_BLOCK


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """The ``[N, K]`` of a packed weight."""
    return packed.shape[0] * PACKED_BLOCK, packed.shape[1] * 2


# Rows up to which ``linear_int8`` runs the C kernel (see ``linear_int8_max_rows``); past them
# the weight is dequantized to the rows' dtype a chunk at a time and torch's GEMM multiplies
# (many rows: compute-bound). Measured on a 2-core AVX512-BF16/VNNI EPYC (2026-12-04, bf16
# rows, bench/RESULTS.md): with per-channel scales the VNNI path won up to 64 rows on every
# shape (8192x2048: 7.0 against 18.0 ms at 64, 13.8 against 27.5 at 128; SmolLM2's 1536x576:
# 0.54 against 0.58 at 64, 1.11 against 0.88 at 128). With groups of 32, or on the portable
# path, the float path lost at 32 rows on SmolLM2's shapes (0.56 against 0.39 ms). Groups of 32
# on the VNNI path (a 2-core Xeon with AMX, 2026-12-05, 8192x2048): 4.89 against 6.37 ms at 32
# rows, 7.36 against 6.72 at 48. The fixed-point path on AVX2 (a 2-core AVX2 EPYC, 2026-12-05,
# 8192x2048, bf16 rows) won at every count to 48: per channel 34.9 against 60.9 ms at 32 rows,
# groups of 32 44.6 against 50.9.
LINEAR_INT8_MAX_ROWS = 8
# linear_int8's `path` (cpu_int8.c): the build's fastest, the portable one, the fixed-point
# tiles (not AMX's, the packed GEMM or the columns); and the kernel linear_int8_kernel says a
# call takes
INT8_PATH_BEST, INT8_PATH_PORTABLE, INT8_PATH_TILES = 0, 1, 2
INT8_KERNEL_TILES, INT8_KERNEL_AMX, INT8_KERNEL_PACKED, INT8_KERNEL_COLUMNS = 0, 1, 2, 3
LINEAR_INT8_MAX_ROWS_FIXED_GROUPS = 32
# Per channel on AMX's int8 tiles (a 2-core Xeon with AMX, 2026-12-06, bf16 rows, the 1B's four
# matrices, ms for all four): 15.2 against dequantize + GEMM's 51.2 at 64 rows, 29.7 against
# 57.8 at 128, 97.7 against 119.0 at 512, 125.8 against 147.9 at 640, 157.4 against 148.6 at
# 768 (the VNNI path: 29.6, 63.5, 246.5). A decode step's layers in one call to as many rows,
# against layer by layer on the same C linears (the 1B, ms a step): 156.6 against 173.1 at 32
# rows, 286.2 against 297.4 at 64, 514.4 against 543.8 at 128, 821.1 against 817.9 at 256.
LINEAR_INT8_MAX_ROWS_AMX = 512
# Per channel on the packed AVX2 GEMM (a 2-core AVX2 Zen 3 EPYC, 2026-12-06, bf16 rows, the 1B's
# four matrices, GFLOP/s): 144 against dequantize + GEMM's 51 at 64 rows, 114 against 94 at
# 512, 154 against 92 at 1,574, 143 against 96 at 2,048: past every count measured, so no limit
# (the C kernel takes x a chunk of 1024 rows at a time).
LINEAR_INT8_MAX_ROWS_PACKED = EVERY_ROW_COUNT
# Per channel on the columns with VNNI (a 2-core Zen 4 EPYC, 2026-12-07, bf16 rows, the 1B's
# 8192x2048 and 2048x8192, GOP/s): 334-349 against dequantize + GEMM's 187-193 at 128 rows,
# 322-344 against 250-256 at 256, 333-342 against 297-312 at 512, 332-336 against 323-337 at
# 1,024 (torch's GEMM gains with more rows; a prefill chunk of 2,048 goes to it).
LINEAR_INT8_MAX_ROWS_COLUMNS = 1024


@cache
def linear_int8_max_rows(group: int) -> int:
    """The most rows ``linear_int8`` runs in the C kernel for weights with a scale per
    ``group`` inputs (0: one per output channel), asked of the built library as
    ``linear_max_rows`` does: per channel ``LINEAR_INT8_MAX_ROWS_AMX`` where it runs on AMX's
    tiles, ``LINEAR_INT8_MAX_ROWS_PACKED`` (every row count) on the packed AVX2 GEMM,
    ``LINEAR_INT8_MAX_ROWS_COLUMNS`` on VNNI's columns (the fixed-point path has one of the
    two); for groups of 32 (Q8_0's) ``LINEAR_INT8_MAX_ROWS_FIXED_GROUPS`` on the fixed-point
    path; else ``LINEAR_INT8_MAX_ROWS``."""
    lib = library("cpu_int8")
    if group == 0 and lib.linear_int8_has_amx():
        return LINEAR_INT8_MAX_ROWS_AMX
    if group == 0 and lib.linear_int8_has_packed():
        return LINEAR_INT8_MAX_ROWS_PACKED
    if group == 0 and lib.linear_int8_has_columns():
        return LINEAR_INT8_MAX_ROWS_COLUMNS
    if group == 32 and lib.linear_int8_has_fixed():
        return LINEAR_INT8_MAX_ROWS_FIXED_GROUPS
    return LINEAR_INT8_MAX_ROWS


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.int8.linear_reference(x, q, scale, bias)`` on the CPU, in ``x``'s dtype.

    Up to ``linear_int8_max_rows`` rows of ``x`` go through the C kernel, which reads the int8
    weight once; more go to torch's GEMM on the weight dequantized to ``x``'s dtype (to float32
    where it is bf16 and the CPU has no bf16 arithmetic), a chunk of rows at a time
    (``_linear_chunked``: the whole dequantized matrix is never in memory).
    """
    from kernels import int8

    if x.dim() == 2 and x.shape[0] <= linear_int8_max_rows(int8.scale_group(q, scale)) and (
            x.dtype in LINEAR_MAX_ROWS):
        return linear_int8_rows(x, q, scale, bias)

    group = int8.group_size(q, scale)
    q, scale = q.contiguous(), scale.contiguous()
    wide = x.dtype == torch.bfloat16 and not cpu_has_native_bf16()

    def dequantized_rows(chunk: torch.Tensor, n0: int) -> None:
        # int8.dequantize of these rows: q * scale in float32 (through the thread's float32
        # buffer where the chunk is narrower: a mul straight into bf16 makes a fresh float32
        # temporary, 63 ms against 16 for 32 rows by 8192x2048 on an AVX512-BF16 EPYC),
        # rounded to the chunk's dtype
        rows = chunk.shape[0]
        f32 = chunk if chunk.dtype == torch.float32 else (
            _chunk_buffer(chunk.numel(), torch.float32)[: chunk.numel()].view_as(chunk))
        torch.mul(q[n0 : n0 + rows].view(rows, -1, group), scale[n0 : n0 + rows, :, None],
                  out=f32.view(rows, -1, group))
        if f32 is not chunk:
            chunk.copy_(f32)

    return _linear_chunked(x, q.shape[0], torch.float32 if wide else x.dtype, dequantized_rows,
                           bias)


def linear_int8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, portable: bool = False,
                     tiles: bool = False) -> torch.Tensor:
    """The int8 linear through the C kernel whatever the rows of ``x`` ([M, K], float32 or
    bf16; ``q`` [N, K] int8, ``scale`` [N, K / G] float32), in ``x``'s dtype.

    Each output is reduced in one order fixed by K and G alone (batch-invariant).
    ``portable`` forces the portable path where the build has the AVX-512 one, ``tiles`` the
    fixed-point tiles where per-channel weights would take AMX's tiles, the packed GEMM or the
    columns (for tests; the same bits).
    """
    from kernels import int8

    if x.dtype not in LINEAR_MAX_ROWS:
        raise TypeError(f"no C int8 linear for {x.dtype} rows")
    group = int8.group_size(q, scale)
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"rows of {x.shape[-1]} inputs by a weight of {q.shape[1]}")
    q, scale, x = q.contiguous(), scale.contiguous(), x.contiguous()
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    out = x.new_empty(x.shape[0], q.shape[0])
    library("cpu_int8").linear_int8(
        x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr(), scale.data_ptr(),
        None if bf is None else bf.data_ptr(), out.data_ptr(), int(out.dtype == torch.bfloat16),
        x.shape[0], q.shape[0], q.shape[1], group, INT8_PATH_PORTABLE if portable else (
            INT8_PATH_TILES if tiles else INT8_PATH_BEST), torch.get_num_threads(),
    )
    return out


def _dtype_code(t: torch.Tensor) -> int:
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"no CPU kernel for {t.dtype} tensors")
    return DTYPE_CODES[t.dtype]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * rms_norm(x)`` over the last dim, as transformers' RMSNorm rounds it.

    With ``residual``, ``residual`` first becomes ``x + residual`` (in place, rounded to the
    dtype) and that sum is normalised: the residual add and the next norm in one pass.
    """
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("rms_norm needs contiguous tensors")
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm needs a contiguous residual")
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    library("cpu_layer").rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.numel() // hidden, hidden, eps, _dtype_code(x),
        torch.get_num_threads(),
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` ([T, heads, D], rows may be strided) in place by ``cos``/``sin`` ([T, D]).

    ``x * cos + rotate_half(x) * sin`` with every product and sum rounded to the dtype.
    """
    rows, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or not (cos.is_contiguous()
                                                              and sin.is_contiguous()):
        raise ValueError("rotary_ needs contiguous heads and contiguous cos/sin tables")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError("rotary_ needs cos/sin in the dtype of x")
    library("cpu_layer").rotary(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim,
        _dtype_code(x), torch.get_num_threads(),
    )


class LoRATable(ctypes.Structure):
    """One projection's LoRA adapters by slot, as ``cpu_linear.c``'s ``lora_add`` reads them
    (its ``struct lora_slots``): slot ``s`` holds ``(A [r, in], Bt [r, out])`` or None.
    ``kernels.lora.LoRASlots`` keeps one per projection and :meth:`set` refreshes it in place
    when its slots change, so its address (which :class:`DecodeLayers` is given) stays valid."""

    _fields_ = [("num_slots", ctypes.c_int64), ("a", ctypes.c_void_p), ("bt", ctypes.c_void_p),
                ("rank", ctypes.c_void_p)]

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None] = ()) -> None:
        super().__init__()
        self.set(pairs)

    def set(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Point at ``pairs`` (contiguous CPU tensors of one dtype, float32 or bf16, every
        slot's of one ``in`` and ``out``), kept alive here (as ``pairs``) until the next
        ``set``."""
        present = [p for p in pairs if p is not None]
        if any(a.dim() != 2 or b.dim() != 2 or b.shape[0] != a.shape[0]
               or not (a.is_contiguous() and b.is_contiguous())
               or {a.dtype, b.dtype} != {present[0][0].dtype} or a.device.type != "cpu"
               or b.device.type != "cpu" for a, b in present) or len(
                {(a.shape[1], b.shape[1]) for a, b in present}) > 1:
            raise ValueError("a LoRATable needs contiguous CPU pairs A [r, in], Bt [r, out] "
                             "of one dtype and one in and out")
        if present and present[0][0].dtype not in LINEAR_MAX_ROWS:
            raise TypeError(f"no C LoRA kernel for {present[0][0].dtype} adapters")
        n = len(pairs)
        arrays = ((ctypes.c_void_p * n)(*(None if p is None else p[0].data_ptr() for p in pairs)),
                  (ctypes.c_void_p * n)(*(None if p is None else p[1].data_ptr() for p in pairs)),
                  (ctypes.c_int64 * n)(*(0 if p is None else p[0].shape[0] for p in pairs)))
        # the fields repointed before the arrays they pointed into are let go
        self.num_slots = 0
        self.a, self.bt, self.rank = (ctypes.addressof(arr) for arr in arrays)
        self.num_slots = n
        self._arrays, self.pairs = arrays, list(pairs)
        # (in, out) of the adapted projection, and the adapters' dtype; None without adapters
        self.io = (present[0][0].shape[1], present[0][1].shape[1]) if present else None
        self.dtype = present[0][0].dtype if present else None


def lora_tables(tables: Sequence[LoRATable]) -> ctypes.Array:
    """The addresses of ``tables`` as :class:`DecodeLayers` takes them: the tables must stay
    alive (and be refreshed in place) while it is used."""
    return (ctypes.c_void_p * len(tables))(*(ctypes.addressof(t) for t in tables))


def lora_add_(x: torch.Tensor, y: torch.Tensor, table: LoRATable,
              index: torch.Tensor) -> torch.Tensor:
    """``y`` ([M, out]) plus, in place, each row's adapter product of ``x`` ([M, in]): row
    ``m`` of slot ``s = index[m]`` (``[M]`` int32; -1 or a slot the table has no pair for: none)
    gets ``(x[m] @ A[s].T) @ Bt[s]``, in float32, added and rounded once. A row's result does
    not depend on the other rows (the slot's rows are shrunk together in ``linear_rows``' order,
    and expanded a few at a time, each output of a row summed over the rank in one order)."""
    if table.dtype is None:
        return y
    rows = x.shape[0]
    if not (x.dim() == y.dim() == 2 and y.shape[0] == rows and index.shape == (rows,)):
        raise ValueError(f"lora_add_: x {tuple(x.shape)}, y {tuple(y.shape)} and index "
                         f"{tuple(index.shape)} are not of one step's rows")
    if (x.shape[1], y.shape[1]) != table.io:
        raise ValueError(f"lora_add_: a projection {x.shape[1]} -> {y.shape[1]}, adapters of "
                         f"{table.io[0]} -> {table.io[1]}")
    if not (x.dtype == y.dtype == table.dtype and x.is_contiguous() and y.is_contiguous()
            and index.dtype == torch.int32 and index.is_contiguous()):
        raise ValueError("lora_add_ needs contiguous x and y of the adapters' dtype and an "
                         "int32 index")
    library("cpu_linear").lora_add(
        x.data_ptr(), y.data_ptr(), _dtype_code(x), ctypes.addressof(table), index.data_ptr(),
        rows, y.shape[1], x.shape[1], torch.get_num_threads(),
    )
    return y


def head_norms_(x: torch.Tensor, num_heads: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> None:
    """Qwen3's per-head q and k RMSNorm, in place: ``x`` ([T, heads, D], rows may be strided)
    holds ``num_heads`` query heads, normed by ``q_weight`` ([D]), then key heads, normed by
    ``k_weight``; each head as :func:`rms_norm` norms a row."""
    rows, heads, head_dim = x.shape
    if not 0 <= num_heads <= heads:
        raise ValueError(f"head_norms_: {num_heads} query heads of {heads}")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("head_norms_ needs contiguous heads")
    if not all(w.dtype == x.dtype and w.is_contiguous() and w.shape == (head_dim,)
               for w in (q_weight, k_weight)):
        raise ValueError(f"head_norms_ needs contiguous [{head_dim}] weights of x's dtype")
    library("cpu_layer").head_norms(
        x.data_ptr(), x.stride(0), q_weight.data_ptr(), k_weight.data_ptr(), rows, num_heads,
        heads - num_heads, head_dim, eps, _dtype_code(x), torch.get_num_threads(),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat([gate, up], -1)``, rounded as torch rounds."""
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul needs a contiguous input")
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    library("cpu_layer").silu_mul(
        gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width,
        _dtype_code(gate_up), torch.get_num_threads(),
    )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a contiguous float32/bf16/fp16 ``x``, in one pass per row
    (torch's CPU argmax is several times slower and wants float32 for speed)."""
    if not x.is_contiguous():
        raise ValueError("argmax needs a contiguous input")
    n = x.shape[-1]
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library("cpu_layer").argmax_rows(
        x.data_ptr(), out.data_ptr(), x.numel() // n, n, _dtype_code(x), torch.get_num_threads()
    )
    return out


def mask_rows_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf where bit ``t`` of ``bitmask[i]`` is clear, in place.

    ``logits``: [N, vocab] float32 with unit stride in the vocabulary; ``bitmask``: [len(rows),
    ceil(vocab / 32)] int32, contiguous (token ``t`` at bit ``t % 32`` of word ``t // 32``, as
    xgrammar packs it); ``rows``: int64. The reference is ``kernels.reference.mask_rows_``.
    """
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("mask_rows_ needs float32 logits with a unit-stride last dimension")
    words = (logits.shape[1] + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.shape != (rows.numel(), words):
        raise ValueError(f"mask_rows_ needs an int32 bitmask of shape ({rows.numel()}, "
                         f"{words}), got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]:
        raise ValueError("mask_rows_: a row index is outside the logits")
    bitmask, rows = bitmask.contiguous(), rows.to(torch.int64).contiguous()
    library("cpu_layer").mask_rows(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
        rows.data_ptr(), rows.numel(), logits.shape[1], torch.get_num_threads())


@dataclass(frozen=True)
class PrefixSeed:
    """Attention over a shared prefix, computed once, that decode rows start from."""

    rows: torch.Tensor  # [R] int64: the decode rows that share the prefix
    num_blocks: int  # the prefix's length in blocks; those rows skip them
    out: torch.Tensor  # [R, H, D] float32: each row's attention over the prefix
    lse: torch.Tensor  # [R, H] float32: and its log-sum-exp


def paged_decode(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= max_blocks]
    seq_lens: torch.Tensor,  # [B], each >= 1
    scale: float,
    prefix: PrefixSeed | None = None,
    split_kv: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 out [B, H, D], lse [B, H]
    """Decode attention over the paged cache; float32 output and log-sum-exp per head.

    With ``prefix``, its rows start from the prefix's attention and read only the blocks
    after it (cascade attention, merged exactly by the online softmax). With fewer rows than
    threads the kernel cuts each row's blocks into runs merged after (split-K), so a row's
    result depends on how many rows share the call; ``split_kv=False`` runs each row whole,
    in one order whatever the batch.
    """
    if key_cache.dtype not in DTYPE_CODES:
        raise TypeError(f"no CPU decode kernel for a {key_cache.dtype} KV cache")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    threads = torch.get_num_threads()  # the kernel splits rows' blocks when rows < threads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32)
    seed_rows = seed_out = seed_lse = None
    prefix_blocks = 0
    if prefix is not None:
        seed_rows = torch.full((num_seqs,), -1, dtype=torch.int32)
        seed_rows[prefix.rows] = torch.arange(len(prefix.rows), dtype=torch.int32)
        seed_out = prefix.out.to(torch.float32).contiguous()
        seed_lse = prefix.lse.to(torch.float32).contiguous()
        prefix_blocks = prefix.num_blocks

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    library("cpu_decode").paged_decode(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        DTYPE_CODES[key_cache.dtype], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), lse.data_ptr(), ptr(seed_rows), prefix_blocks, ptr(seed_out),
        ptr(seed_lse), threads if split_kv else max(1, min(threads, num_seqs)),
    )
    return out, lse


def reshape_and_cache(
    key: torch.Tensor,  # [T, H_kv, D], rows may be strided (views into the qkv projection)
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding (skipped)
) -> None:
    """Write each token's K and V into its slot of the block pool (see the reference)."""
    row = key.shape[1] * key.shape[2]
    for t, pool in ((key, key_cache), (value, value_cache)):
        if t.dtype != pool.dtype or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("reshape_and_cache needs rows of the cache's dtype, heads packed")
        if not pool.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
    slots = slot_mapping.to(torch.int64).contiguous()
    library("cpu_decode").reshape_and_cache(
        key.data_ptr(), value.data_ptr(), key.stride(0) * key.element_size(),
        value.stride(0) * value.element_size(), key_cache.data_ptr(), value_cache.data_ptr(),
        slots.data_ptr(), slots.numel(), row * key.element_size(),
    )


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A weight's shape, a packed one's as it was before packing (:func:`packed_shape`)."""
    return packed_shape(t) if is_packed(t) else tuple(t.shape)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as :class:`DecodeLayers` takes them: the model's own tensors
    (norm weights ``[hidden]``, linear weights ``[out, in]``, the qkv bias ``[q + 2 kv]``); with
    int8 projections (``kernels.int8``), their float32 scales ``[out, in / G]``; with per-head
    q and k norms (Qwen3), their weights ``[head_dim]``."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # qkv, o,
    # gate_up, down
    head_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # Qwen3's q and k norms, [D]


class DecodeLayers:
    """A Llama-family model's decoder layers, run for a decode step in one C call
    (``cpu_step.c``): the same kernels in the same order as the layer-by-layer path with the
    fused CPU ops, so the same output bit for bit, without the ~300 Python-level calls.

    It holds the weights' addresses: build it once they are loaded, and keep them in place.
    Steps of more rows than :attr:`max_rows` (where ``linear`` goes to torch's GEMM) are not
    for it. Int8 projections (every layer's, with ``scales``) go through ``linear_int8``'s C
    kernel, one scale group size for the model; the others through :func:`linear`'s
    (``linear_small``, whose order of reduction changes with the rows: the batch-invariant mode
    never runs a step in one call, its steps having no cascade metadata).
    """

    def __init__(self, layers: list[LayerWeights], num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float) -> None:
        dtype = layers[0].input_norm.dtype
        if dtype not in LINEAR_MAX_ROWS:
            raise TypeError(f"no CPU decode-step kernel for {dtype} weights")
        quantized = layers[0].scales is not None
        self.dtype = dtype
        self.group = 0  # the int8 projections' inputs per scale; 0: one scale per channel
        if quantized:
            from kernels import int8

            groups = {int8.scale_group(w, s) for layer in layers if layer.scales is not None
                      for w, s in zip((layer.qkv, layer.o, layer.gate_up, layer.down),
                                      layer.scales, strict=True)}
            if len(groups) != 1 or any(layer.scales is None for layer in layers):
                raise ValueError("DecodeLayers needs every layer's projections int8 with one "
                                 f"group size, or none (got group sizes {sorted(groups)})")
            self.group = groups.pop()
        # bf16 projections packed for the dot product (pack_bf16): every layer's four, or none
        self.packed = is_packed(layers[0].qkv)
        if self.packed and dtype != torch.bfloat16:  # e.g. a packed model made float32 after
            raise ValueError(f"DecodeLayers takes packed bf16 projections in a bf16 model, "
                             f"not {dtype}")
        self.max_rows = (linear_int8_max_rows(self.group) if quantized
                         else LINEAR_MAX_ROWS_PACKED_DOT if self.packed
                         else linear_max_rows(dtype))
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.hidden = logical_shape(layers[0].qkv)[1]
        self.intermediate = logical_shape(layers[0].down)[1]
        self.eps, self.scale = eps, scale
        # float32 biases, as ``linear`` makes them for its kernel; kept alive here
        self._biases = [None if w.qkv_bias is None else w.qkv_bias.to(torch.float32).contiguous()
                        for w in layers]
        pointers: list[int | None] = []
        hidden, inter = self.hidden, self.intermediate
        q_size, qkv_size = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
        shapes = ((hidden,), (qkv_size, hidden), (hidden, q_size), (hidden,),
                  (2 * inter, hidden), (hidden, inter))
        for w, bias in zip(layers, self._biases, strict=True):
            tensors = (w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down)
            if (tuple(logical_shape(t) for t in tensors) != shapes
                    or (bias is not None and tuple(bias.shape) != (qkv_size,))):
                raise ValueError("DecodeLayers: the layers' weights do not have the shapes of "
                                 f"{num_heads} heads, {num_kv_heads} KV heads of {head_dim}")
            projection = (torch.int8 if quantized else torch.int32 if self.packed else dtype)
            dtypes = (dtype, projection, projection, dtype, projection, projection)
            scales, norms = w.scales or (), w.head_norms or ()
            if (w.head_norms is None) != (layers[0].head_norms is None) or any(
                    t.shape != (head_dim,) for t in norms):
                raise ValueError(f"DecodeLayers needs per-head q/k norms of [{head_dim}] in "
                                 "every layer or in none")
            if any(t.dtype != d or not t.is_contiguous() or t.device.type != "cpu"
                   for t, d in zip((*tensors, *norms), (*dtypes, *(dtype,) * len(norms)),
                                   strict=True)) or any(
                    s.dtype != torch.float32 or not s.is_contiguous() for s in scales):
                raise ValueError("DecodeLayers needs contiguous CPU weights of one dtype (int8 "
                                 "projections with float32 scales, or all bf16 ones packed)")
            pointers += [w.input_norm.data_ptr(), w.qkv.data_ptr(),
                         None if bias is None else bias.data_ptr(), w.o.data_ptr(),
                         w.post_norm.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr()]
            pointers += [s.data_ptr() for s in scales] if scales else [None] * 4
            pointers += [t.data_ptr() for t in norms] if norms else [None] * 2
        self.num_layers = len(layers)
        self._layers = layers  # what the addresses point into stays alive with them
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)
        self._kernels = (ctypes.c_void_p * len(STEP_KERNELS))(
            *(ctypes.cast(library(lib)[fn], ctypes.c_void_p).value for lib, fn in STEP_KERNELS))

    def __call__(
        self,
        residual: torch.Tensor,  # [T, hidden]: the embeddings; becomes the residual stream
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, head_dim] in the dtype
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, block_size, H_kv, D]
        slot_mapping: torch.Tensor,  # [T]
        block_tables: torch.Tensor,  # [T, max_blocks]
        seq_lens: torch.Tensor,  # [T]
        lora: tuple[ctypes.Array, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden]: the last layer's MLP output
        """Run every layer for ``T`` decode rows (one token of each of ``T`` sequences).

        ``lora``: with adapted rows, every layer's qkv, o, gate_up and down adapter tables in
        that order (:func:`lora_tables`) and the rows' slots (``[T]`` int32, -1: none); each
        projection adds its rows' products as ``lora_add_`` does."""
        rows = residual.shape[0]
        cos, sin = rope
        if rows > self.max_rows:
            raise ValueError(f"DecodeLayers runs up to {self.max_rows} rows, got {rows}")
        if not all(t.dtype == self.dtype and t.is_contiguous()
                   for t in (residual, kv_caches, cos, sin)):
            raise ValueError("DecodeLayers needs contiguous tensors of the weights' dtype")
        if any(t.shape[0] != rows for t in (cos, sin, slot_mapping, block_tables, seq_lens)):
            raise ValueError(f"DecodeLayers: the step's metadata is not of {rows} rows")
        if kv_caches.shape[0] != self.num_layers:
            raise ValueError(f"{kv_caches.shape[0]} KV caches for {self.num_layers} layers")
        if lora is not None and (len(lora[0]) != 4 * self.num_layers
                                 or lora[1].shape != (rows,) or lora[1].dtype != torch.int32
                                 or not lora[1].is_contiguous()):
            raise ValueError(f"DecodeLayers needs 4 adapter tables a layer ({self.num_layers} "
                             f"layers) and the {rows} rows' int32 slots")
        num_heads, num_kv_heads, head_dim = self.shape
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        x = torch.empty_like(residual)
        size = kv_caches.element_size()
        library("cpu_step").decode_layers(
            self._kernels, self._weights, self.num_layers, residual.data_ptr(), x.data_ptr(),
            DTYPE_CODES[self.dtype], rows, self.hidden, num_heads, num_kv_heads, head_dim,
            self.intermediate, self.eps, cos.data_ptr(), sin.data_ptr(), kv_caches.data_ptr(),
            kv_caches.stride(0) * size, kv_caches.stride(1) * size, slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), kv_caches.shape[3],
            self.scale, self.group, int(self.packed), None if lora is None else lora[0],
            None if lora is None else lora[1].data_ptr(), torch.get_num_threads(),
        )
        return x


@contextmanager
def labelled_for_profiler() -> Iterator[None]:
    """Within the block, every C kernel shows up in ``torch.profiler`` as ``kvbatch::<name>``.

    Wraps the loaded libraries' functions in ``record_function`` and restores them on exit:
    the wrapper costs a few microseconds per call even with no profiler running.
    """
    originals = []
    for name, (_, functions) in LIBRARIES.items():
        lib = library(name)
        for function in functions:
            original = getattr(lib, function)
            originals.append((lib, function, original))
            setattr(lib, function, _labelled(f"kvbatch::{function}", original))
    try:
        yield
    finally:
        for lib, function, original in originals:
            setattr(lib, function, original)


def _labelled(label: str, function: Callable[..., None]) -> Callable[..., None]:
    def call(*args: object) -> None:
        with torch.profiler.record_function(label):
            function(*args)

    return call
