"""Triton paged-attention prefill: varlen chunks of new tokens over their paged context.

The new tokens of all sequences are flattened (``query_start_loc``). One program owns a
(query block, KV head): ``BLOCK_Q`` consecutive new tokens of one sequence times the GROUP
query heads of the KV head, packed as the ``BLOCK_M = BLOCK_Q * GROUP`` (padded) rows of one
tile. Query blocks are numbered without a device sync: sequence ``i`` owns the blocks from
``query_start_loc[i] // BLOCK_Q + i``, an upper bound that leaves at most one spare block per
sequence, and each program finds its sequence by binary search. Keys are the cached prefix
(prefix-cache hits, earlier chunks) in full, then the chunk itself causally.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.online_softmax import (
    LOG2_E,
    TILE_N,
    attend_paged_tiles,
    block_d,
    cache_strides,
    check_paged_attention_args,
    dot_config,
    normalise,
)

BLOCK_M = 64  # query rows (tokens x heads of a group) per program


@triton.jit
def _find_seq(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    # The last sequence whose first query block is <= q_block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    num_seqs,
    qk_scale,
    stride_out_token,
    stride_out_head,
    stride_query_token,
    stride_query_head,
    stride_key_cache_block,
    stride_key_cache_token,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_token,
    stride_value_cache_head,
    stride_block_tables_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # a spare block of the numbering
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok = local_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M], token within the chunk
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    mask_m = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(
        query_ptr
        + (q_start + q_tok)[:, None] * stride_query_token
        + heads[:, None] * stride_query_head
        + offs_d[None, :],
        mask=mask_md,
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    query_pos = tl.where(mask_m, prefix_len + q_tok, -1)  # padding rows see no key

    # Keys past the block's last query token are all in its causal future.
    end = tl.minimum(seq_len, prefix_len + (local_block + 1) * BLOCK_Q)
    acc, _m_i, l_i = attend_paged_tiles(
        q,
        query_pos,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + seq * stride_block_tables_seq,
        kv_head,
        0,
        end,
        qk_scale,
        stride_key_cache_block,
        stride_key_cache_token,
        stride_key_cache_head,
        stride_value_cache_block,
        stride_value_cache_token,
        stride_value_cache_head,
        BLOCK_SIZE,
        TILE_N,
        HEAD_DIM,
        DOT_DTYPE,
        DOT_PRECISION,
    )

    out = normalise(acc, l_i)
    out_offs = (
        (q_start + q_tok)[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + offs_d[None, :]
    )
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


def _launch_paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,  # tests pass a poisoned one to see every element written
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    out = check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, out)
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert query_start_loc.is_contiguous()
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    dot_dtype, dot_precision = dot_config(query.dtype)
    num_q_blocks = num_tokens // block_q + num_seqs  # see the module docstring
    _paged_prefill_kernel[(num_q_blocks, num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        num_seqs,
        scale * LOG2_E,
        out.stride(0),
        out.stride(1),
        query.stride(0),
        query.stride(1),
        *cache_strides(key_cache, value_cache),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=block_d(head_dim),
        TILE_N=TILE_N,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
    )
    return out


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], new tokens of all sequences
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Varlen attention of chunks of new tokens over their paged context (chunked prefill).

    Args:
        query: the new tokens of all sequences, flattened; fp16, bf16 or fp32 (the cache's).
        key_cache, value_cache: the block pool of one layer; the new tokens' K/V must already
            be written (``reshape_and_cache`` first).
        block_tables: logical block -> physical block, per sequence; rows may be padded.
            Each row must cover its sequence: ``seq_len <= block_tables.shape[1] * block_size``
            (not checked: it would cost a device sync).
        query_start_loc: prefix sums of the new tokens per sequence, starting at 0.
        seq_lens: context length per sequence including its new tokens; a sequence with
            ``q_len`` new tokens attends to its ``seq_len - q_len`` cached tokens in full and
            causally within the chunk.
        scale: the softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        The attention output, in the query's dtype (accumulated in fp32).
    """
    return _launch_paged_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
    )
