"""Triton batched LoRA (``kernels.lora``'s CUDA path): a shrink kernel, then an expand kernel.

Each row reads its own adapter's weights (BGMV, as Punica's decode kernels): right for the
few rows per adapter of decode steps, and correct for any step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] the projection's input
    a_ptr,  # [S, R, K] stacked A, zero-padded to R
    index_ptr,  # [T] int32 slot of each row, -1: none
    out_ptr,  # [T, R] float32
    K,
    R,
    stride_x_t,
    stride_a_s,
    stride_a_r,
    stride_out_t,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(index_ptr + row)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + row * stride_x_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_a_s + offs_r[:, None] * stride_a_r + offs_k[None, :],
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_out_t + offs_r, acc, mask=mask_r)


@triton.jit
def _expand_kernel(
    shrunk_ptr,  # [T, R] float32
    b_ptr,  # [S, N, R] stacked B (scaling included), zero-padded to R
    index_ptr,  # [T] int32
    y_ptr,  # [T, N] the projection's output, added to in place
    N,
    R,
    stride_shrunk_t,
    stride_b_s,
    stride_b_n,
    stride_y_t,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(index_ptr + row)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_n = offs_n < N
    mask_r = offs_r < R
    shrunk = tl.load(shrunk_ptr + row * stride_shrunk_t + offs_r, mask=mask_r, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_b_s + offs_n[:, None] * stride_b_n + offs_r[None, :],
        mask=mask_n[:, None] & mask_r[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    delta = tl.sum(b * shrunk[None, :], axis=1)
    y_offs = y_ptr + row * stride_y_t + offs_n
    y = tl.load(y_offs, mask=mask_n).to(tl.float32)
    tl.store(y_offs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask_n)


def _launch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            index: torch.Tensor) -> None:
    t, k = x.shape
    r = a.shape[1]
    n = y.shape[1]
    shrunk = torch.empty((t, r), dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(r))
    _shrink_kernel[(t,)](
        x, a, index, shrunk, k, r, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )
    block_n = 64
    _expand_kernel[(t, triton.cdiv(n, block_n))](
        shrunk, b, index, y, n, r, shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )


def add_lora_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    index: torch.Tensor) -> torch.Tensor:
    """``kernels.lora.add_lora_reference`` in place on ``y``, as Triton kernels.

    Args:
        x: ``[T, in]``, rows contiguous. y: ``[T, out]``, rows contiguous, the same dtype.
        a: ``[S, R, in]`` contiguous. b: ``[S, out, R]`` contiguous.
        index: ``[T]`` int32, each row's slot (-1: none).
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[0] != index.shape[0]:
        raise ValueError(f"shapes x {tuple(x.shape)}, y {tuple(y.shape)}, index "
                         f"{tuple(index.shape)} do not match")
    if a.shape[2] != x.shape[1] or b.shape[1] != y.shape[1] or a.shape[:2] != (
            b.shape[0], b.shape[2]):
        raise ValueError(f"weights A {tuple(a.shape)}, B {tuple(b.shape)} do not fit x "
                         f"{tuple(x.shape)}, y {tuple(y.shape)}")
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    assert a.is_contiguous() and b.is_contiguous(), "stacked weights must be contiguous"
    assert index.dtype == torch.int32, "index must be int32"
    if x.shape[0]:
        _launch(x, y, a, b, index)
    return y
