"""What the decode and prefill kernels share: the online-softmax loop over paged K/V tiles, and
the checks and constants of their launchers.

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
TILE_N = 64  # key tokens per inner-loop step (several KV blocks when block_size < 64)


@triton.jit
def attend_paged_tiles(
    q,  # [BLOCK_M, BLOCK_D] DOT_DTYPE
    query_pos,  # [BLOCK_M] int32, position of each row's token; it sees keys at <= query_pos
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [max_blocks_per_seq] int32, this sequence's row of block_tables
    kv_head,
    start,  # first key token to visit (0, or a multiple of TILE_N)
    end,  # one past the last key token to visit
    qk_scale,
    stride_key_cache_block,
    stride_key_cache_token,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_token,
    stride_value_cache_head,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Returns acc [BLOCK_M, BLOCK_D] (sum of p * v, unnormalised), m_i [BLOCK_M] (the running
    # max of the scores in the log2 domain, -inf for a row that saw no key) and l_i [BLOCK_M]
    # (the sum of exp2(score - m_i)), all fp32.
    acc = tl.zeros([q.shape[0], q.shape[1]], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    offs_d = tl.arange(0, q.shape[1])
    mask_d = offs_d < HEAD_DIM
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        mask_n = offs_n < end
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        block = block.to(tl.int64)  # block * stride overflows int32 on large pools
        offs_t = offs_n % BLOCK_SIZE
        # k: [BLOCK_D, TILE_N] (transposed for the dot), v: [TILE_N, BLOCK_D]
        k_offs = (
            block[None, :] * stride_key_cache_block
            + offs_t[None, :] * stride_key_cache_token
            + kv_head * stride_key_cache_head
            + offs_d[:, None]
        )
        k = tl.load(key_cache_ptr + k_offs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        v_offs = (
            block[:, None] * stride_value_cache_block
            + offs_t[:, None] * stride_value_cache_token
            + kv_head * stride_value_cache_head
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


@triton.jit
def normalise(acc, l_sum):
    # acc / l_sum row by row; a row that saw no key (l_sum == 0, acc == 0) comes out as zeros.
    return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]


def dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str | None]:
    """``DOT_DTYPE`` and ``DOT_PRECISION`` for inputs of ``dtype``.

    fp32 uses exact IEEE products (TF32 would miss the 1e-5 tolerance). ``input_precision`` only
    means something for fp32 operands, so fp16/bf16 pass None. Triton's interpreter stores bf16
    as raw uint16 and its ``tl.dot`` multiplies those integers, so under the interpreter bf16
    operands are widened to fp32 first (exact; the GPU multiplies bf16 exactly into an fp32
    accumulator too).
    """
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if dtype == torch.float16:
        return tl.float16, None
    if dtype == torch.bfloat16:
        return (tl.float32, "ieee") if triton.knobs.runtime.interpret else (tl.bfloat16, None)
    raise ValueError(f"unsupported attention dtype {dtype}")


def block_d(head_dim: int) -> int:
    """``BLOCK_D``: head_dim padded to a power of two a dot accepts (padding lanes masked)."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """The ``stride_{key,value}_cache_{block,token,head}`` launch arguments, in that order."""
    return (*key_cache.stride()[:3], *value_cache.stride()[:3])


def check_paged_attention_args(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor | None,  # [num_tokens, num_heads, head_dim] or None
) -> torch.Tensor:
    """The layouts both attention kernels assume; returns ``out``, allocated when None."""
    num_seqs = seq_lens.shape[0]
    head_dim = query.shape[2]
    assert key_cache.shape[3] == head_dim and value_cache.shape == key_cache.shape
    assert query.shape[1] % key_cache.shape[2] == 0, "query heads are grouped over KV heads"
    assert query.dtype == key_cache.dtype == value_cache.dtype
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,)
    assert seq_lens.is_contiguous()
    for t in (query, key_cache, value_cache):
        assert t.stride(-1) == 1, "the kernels assume a unit stride along head_dim"
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    return out
