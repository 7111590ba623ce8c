"""Triton linear with one reduction order per output row, whatever the number of rows.

cuBLAS picks its algorithm by shape: another row count can mean another tile, a split-K, or
a different order of the partial sums, so a row's result depends on what shares its GEMM.
Here every program owns one ``BLOCK_M x BLOCK_N`` tile of the output and walks K from 0 in
steps of ``BLOCK_K`` with one float32 accumulator; the block sizes are fixed constants, not
chosen by shape, and there is no split-K. An output element is then the same function of its
row of ``x`` and the weights for any ``M`` and any neighbouring rows: the batch-invariant
mode's linear on CUDA (``kernels.batch_invariant``). As in the Thinking Machines and vLLM
batch-invariant kernels, the price is the tuning cuBLAS would do per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.online_softmax import dot_config

# Fixed, not tuned per shape: a tile's K order must not change with M.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] float32, when HAS_BIAS
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_x_m,
    stride_w_n,
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
        x = tl.load(x_ptr + offs_m[:, None] * stride_x_m + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[:, None] * stride_w_n + (k0 + offs_k)[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)),
                      input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out_m + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1, "the kernel assumes unit K strides"
    out = x.new_empty(m, n)
    if m == 0:
        return out
    bf = None if bias is None else bias.to(torch.float32).contiguous()
    dot_dtype, dot_precision = dot_config(x.dtype)  # fp32 exact, not TF32
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](
        x, weight, bf if bf is not None else out, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bf is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row's result independent of the others.

    Args:
        x: ``[M, K]`` rows, fp32, fp16 or bf16, unit stride along K.
        weight: ``[N, K]`` in ``x``'s dtype, unit stride along K.
        bias: ``[N]`` or None; added in float32.

    Returns:
        ``[M, N]`` in ``x``'s dtype, accumulated in float32 in one order per row.
    """
    return _launch_linear(x, weight, bias)
