"""Native CPU kernels: C sources next to this file, compiled once per CPU and loaded by ctypes.

Inductor needs the same C compiler on the CPU path, so this adds no requirement. The shared
library is built with ``-O3 -march=native -fopenmp`` into ``$KVBATCH_CACHE_DIR/kernels/``
(default ``~/.cache/kvbatch``), named by a hash of the source, the flags, the compiler and the
CPU's feature flags, so that a cache shared between different machines never loads code built
for another instruction set. OpenMP resolves to the ``libgomp.so.1`` that torch has already
loaded, so the kernels and torch share one thread pool runtime. ctypes releases the GIL for
the duration of a call.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine.models.loader import cache_dir

SOURCE = Path(__file__).with_name("cpu_decode.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p


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
        raise RuntimeError("the CPU attention kernels need a C compiler (cc/gcc, or set CC)")
    return cc


@cache
def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *CFLAGS, version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{SOURCE.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run(
                [cc, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed:\n{proc.stderr}")
            built.replace(target)  # atomic: concurrent builders each publish a whole file
    lib = ctypes.CDLL(str(target))
    lib.paged_decode.restype = None
    lib.paged_decode.argtypes = [
        _ptr, _ptr, _ptr, _i32, _ptr, _i64, _ptr,
        _i64, _i64, _i64, _i64, _i64, _f32, _ptr, _ptr, _i32,
    ]
    return lib


def paged_decode(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= max_blocks]
    seq_lens: torch.Tensor,  # [B], each >= 1
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 out [B, H, D], lse [B, H]
    """Decode attention over the paged cache; float32 output and log-sum-exp per head."""
    if key_cache.dtype not in KV_DTYPES:
        raise TypeError(f"no CPU decode kernel for a {key_cache.dtype} KV cache")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32)
    with torch.profiler.record_function("kvbatch::paged_decode"):  # named in profiles
        library().paged_decode(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            KV_DTYPES[key_cache.dtype], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
            out.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
        )
    return out, lse
