"""The online-softmax loop over paged K/V tiles, shared by the decode and prefill kernels.

Both kernels hold a tile of query rows (``BLOCK_M`` rows: query heads of one KV-head group,
times query tokens for prefill) and walk the sequence's keys ``TILE_N`` tokens at a time. A
tile may span several KV blocks: each key token looks up its own physical block in the
sequence's row of ``block_tables``, so ``TILE_N`` is free of the cache's block size.

Scores are kept in the log2 domain (``qk_scale = scale * log2(e)``, then ``exp2``), and all
softmax state is float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
MIN_DOT_DIM = 16  # tl.dot needs every dimension of its operands >= 16 on GPUs


@triton.jit
def attend_paged_tiles(
    acc,  # [BLOCK_M, BLOCK_D] fp32, sum of p * v so far (unnormalised)
    m_i,  # [BLOCK_M] fp32, running max of the scores (log2 domain), -inf before any key
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, BLOCK_D] DOT_DTYPE
    query_pos,  # [BLOCK_M] int32, position of each row's token; it sees keys at <= query_pos
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [max_blocks_per_seq] int32, this sequence's row of block_tables
    kv_head,
    start,  # first key token to visit (a multiple of TILE_N)
    end,  # one past the last key token to visit
    qk_scale,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        mask_n = offs_n < end
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        block = block.to(tl.int64)  # block * stride overflows int32 on large pools
        offs_t = offs_n % BLOCK_SIZE
        # k: [BLOCK_D, TILE_N] (transposed for the dot), v: [TILE_N, BLOCK_D]
        k_offs = (
            block[None, :] * stride_kc_block
            + offs_t[None, :] * stride_kc_token
            + kv_head * stride_kc_head
            + offs_d[:, None]
        )
        k = tl.load(key_cache_ptr + k_offs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        v_offs = (
            block[:, None] * stride_vc_block
            + offs_t[:, None] * stride_vc_token
            + kv_head * stride_vc_head
            + offs_d[None, :]
        )
        v = tl.load(value_cache_ptr + v_offs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)

        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        visible = mask_n[None, :] & (offs_n[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, TILE_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; measure from 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # p is rounded to the cache dtype as the tensor cores would take it.
        p = p.to(value_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """``DOT_DTYPE`` and ``DOT_PRECISION`` for inputs of ``dtype``.

    fp32 uses exact IEEE products (TF32 would miss the 1e-5 tolerance). Triton's interpreter
    stores bf16 as raw uint16 and its ``tl.dot`` multiplies those integers, so under the
    interpreter bf16 operands are widened to fp32 first (exact; the GPU multiplies bf16 exactly
    into an fp32 accumulator too).
    """
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if dtype == torch.float16:
        return tl.float16, "tf32"
    if dtype == torch.bfloat16:
        return (tl.float32, "ieee") if triton.knobs.runtime.interpret else (tl.bfloat16, "tf32")
    raise ValueError(f"unsupported attention dtype {dtype}")
