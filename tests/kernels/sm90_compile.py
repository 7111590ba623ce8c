"""Compile every kernel variant the launchers produce for an H100/H200 (sm_90), without a GPU.

The interpreter runs the kernels' semantics but none of the GPU compiler's checks (``tl.dot``
minimum shapes, loop-carried types, shared memory). This script runs the real launchers with
the kernel launch replaced by ``triton.compile`` down to a cubin (Triton bundles ``ptxas``).
Run it without ``TRITON_INTERPRET``; ``test_sm90_compile.py`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, not this folder

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT_BYTES = 227 * 1024  # per block on sm_90
POINTER_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    values = dict(zip([p.name for p in self.params], args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for p in self.params:
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, int):
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    kernel = triton.compile(ASTSource(self, signature, constexprs), target=TARGET)
    assert kernel.metadata.shared <= SMEM_LIMIT_BYTES, (self.__name__, kernel.metadata.shared)
    print(f"{self.__name__:28} {signature_key(constexprs):60} smem {kernel.metadata.shared:6} B")


def signature_key(constexprs: dict) -> str:
    keep = ("GROUP", "HEAD_DIM", "SPLIT", "BLOCK_M", "DOT_DTYPE")
    return " ".join(f"{k}={v}" for k, v in constexprs.items() if k in keep)


def main() -> None:
    JITFunction.run = compile_instead_of_launch
    from kernels import get_ops
    from kernels.paged_decode import _launch_paged_decode

    ops = get_ops("triton")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (32, 8, 128), (6, 2, 10)):
            block_size, num_seqs = 16, 2
            query = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype)
            key_cache = torch.zeros(64, block_size, num_kv_heads, head_dim, dtype=dtype)
            block_tables = torch.zeros(num_seqs, 32, dtype=torch.int32)
            seq_lens = torch.tensor([5, 500], dtype=torch.int32)
            kv = query[:, :num_kv_heads]
            ops.reshape_and_cache(kv, kv, key_cache, key_cache, torch.arange(num_seqs))
            for num_splits in (1, 4):  # single pass; split-K and its merge
                _launch_paged_decode(
                    query, key_cache, key_cache, block_tables, seq_lens, 0.1, num_splits
                )
            query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
            ops.prefill(query, key_cache, key_cache, block_tables, query_start_loc, seq_lens, 0.1)
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
