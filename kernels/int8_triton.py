"""Triton weight-only int8 linear (``kernels.int8``'s CUDA path).

Every program owns one ``BLOCK_M x BLOCK_N`` tile of the output and walks K from 0 in steps of
``BLOCK_K``: it loads the int8 weights (half the bytes of bf16, the point for decode steps,
which are bound by reading them), widens them and multiplies each by its group's scale in
registers, and accumulates ``x @ w^T`` in float32. The tiles are fixed constants, not chosen
by shape, so a row's result does not depend on the other rows (the batch-invariant mode takes
this kernel as it is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int8 import group_size
from kernels.online_softmax import dot_config

BLOCK_M = 16  # tl.dot's smallest; decode steps have a few rows
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _linear_int8_kernel(
    x_ptr,  # [M, K] fp32/fp16/bf16
    q_ptr,  # [N, K] int8
    scale_ptr,  # [N, K / G] float32
    bias_ptr,  # [N] float32, when HAS_BIAS
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    G,
    stride_x_m,
    stride_q_n,
    stride_scale_n,
    stride_out_m,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        mask_w = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_x_m + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(q_ptr + offs_n[:, None] * stride_q_n + (k0 + offs_k)[None, :],
                    mask=mask_w, other=0)  # [BLOCK_N, BLOCK_K] int8
        s = tl.load(scale_ptr + offs_n[:, None] * stride_scale_n + ((k0 + offs_k) // G)[None, :],
                    mask=mask_w, other=0.0)  # [BLOCK_N, BLOCK_K]: each weight's group scale
        w = q.to(tl.float32) * s
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)),
                      input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out_m + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = q.shape[0]
    g = group_size(q, scale)
    assert q.shape == (n, k), f"rows of {k} inputs by a weight of {q.shape[1]}"
    assert x.stride(1) == 1 and q.stride(1) == 1 and scale.stride(1) == 1, \
        "the kernel assumes unit K strides"
    out = x.new_empty(m, n)
    if m == 0:
        return out
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    dot_dtype, dot_precision = dot_config(x.dtype)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_int8_kernel[grid](
        x, q, scale, bf if bf is not None else out, out, m, n, k, g,
        x.stride(0), q.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bf is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.int8.linear_reference(x, q, scale, bias)`` on the GPU.

    Args:
        x: ``[M, K]`` rows, fp32, fp16 or bf16, unit stride along K.
        q: ``[N, K]`` int8 weights, unit stride along K.
        scale: ``[N, K / G]`` float32, a scale per ``G`` inputs of each output.
        bias: ``[N]`` or None; added in float32.

    Returns:
        ``[M, N]`` in ``x``'s dtype, accumulated in float32. The weights are dequantized in
        float32 and rounded to ``x``'s dtype for the tensor-core product (bf16/fp16 rows).
    """
    return _launch(x, q, scale, bias)
