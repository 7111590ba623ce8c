"""Kernel tests: the Triton ops against ``kernels.reference`` on small, awkward paged batches.

Without CUDA the kernels run under Triton's interpreter, which must be switched on before any
``@triton.jit`` function is defined, i.e. before the kernel modules are imported.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Written into every cache slot no sequence owns. A kernel that reads past a sequence's end or
# through a padding entry of its block table gets keys of 30 (scores of about 30 times the sum
# of a query head, which dominate the softmax for any head whose sum is positive) and values of
# 1e4 (so even a small weight on such a slot moves the output far past the tolerance).
POISON_KEY = 30.0
POISON_VALUE = 1e4
# Relative to the largest reference element (and elementwise, on top).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class PagedBatch:
    """One layer's block pool and the metadata of sequences spread over shuffled blocks."""

    key_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D], a view of a multi-layer pool
    value_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with unowned (poisoned) blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64, the new tokens' slots
    query: torch.Tensor  # [T, H, D], a strided view (as split from a fused qkv projection)
    key: torch.Tensor  # [T, H_kv, D], the new tokens' K (a strided view)
    value: torch.Tensor  # [T, H_kv, D]


def make_paged_batch(
    seqs: list[tuple[int, int]],  # (seq_len, q_len) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    max_blocks = max(blocks_per_seq) + 2  # padded rows, as an engine sizes its tables
    num_blocks = sum(blocks_per_seq) + 5
    physical = torch.randperm(num_blocks, generator=gen)  # shuffled, non-contiguous blocks
    spare = physical[sum(blocks_per_seq) :]
    block_tables = torch.empty(len(seqs), max_blocks, dtype=torch.int32)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for i, ((seq_len, _), n) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        row = physical[used : used + n]
        used += n
        pad = spare[torch.randint(len(spare), (max_blocks - n,), generator=gen)]
        block_tables[i] = torch.cat([row, pad]).int()
        owned[row] = True
        owned[row[-1], seq_len - (n - 1) * block_size :] = False

    # The pool of two layers, [layers, K/V, blocks, block_size, H_kv, D]; the test uses layer 1.
    pool = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    pool[:, 0, ~owned] = POISON_KEY
    pool[:, 1, ~owned] = POISON_VALUE
    pool = pool.to(dtype).to(device)

    q_lens = [q_len for _, q_len in seqs]
    num_tokens = sum(q_lens)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    slots = []
    for i, (seq_len, q_len) in enumerate(seqs):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    return PagedBatch(
        key_cache=pool[1, 0],
        value_cache=pool[1, 1],
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query=qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
        key=qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
        value=qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim),
    )


def check_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element finite and within the dtype's tolerance of the reference."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = TOLERANCE[ref.dtype]
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all(), "an output element was never written (still NaN)"
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.fixture
def paged_batch():
    """The factory ``make_paged_batch``."""
    return make_paged_batch


@pytest.fixture
def cpu_paged_batch():
    """``make_paged_batch`` on the CPU whatever the machine: for the C kernels' tests."""
    return functools.partial(make_paged_batch, device=torch.device("cpu"))


@pytest.fixture
def row_exact_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Triton's interpreter, ``tl.dot`` on float32 tiles as a plain product-then-sum over
    K, in order, for every row alike. The interpreter's own is numpy's matmul, whose BLAS
    (OpenBLAS 0.3.31) rounds a row differently at another position of the tile, so a test of
    a kernel's order of reduction would test numpy's. On CUDA nothing is replaced."""
    if DEVICE.type == "cuda":
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data[:, :, None] * b.data[None, :, :]  # [M, K, N]
        total = np.zeros_like(products[:, 0, :])
        for k in range(products.shape[1]):
            total += products[:, k, :]
        return interpreter.TensorHandle(total.astype(d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.fixture
def assert_matches():
    """``check_matches``: every element finite and within tolerance of the reference."""
    return check_matches
