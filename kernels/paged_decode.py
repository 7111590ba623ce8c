"""Triton paged-attention decode: one new query token per sequence over its paged context.

One program owns a (sequence, KV head, split): it holds the GROUP query heads that share the
KV head as the rows of one tile, so each K/V byte is read once per group, not once per head.
Long contexts are cut into ``num_splits`` partitions (split-K): each program writes an
unnormalised partial result with its softmax max and sum, and a second kernel merges the
partials. With one split the first kernel writes the output directly (``SPLIT=False``).

Cascade (``prefix`` given, as ``kernels.cascade.shared_prefix`` finds it): rows whose block
tables start with the same ``num_blocks`` blocks (one system prompt, prefix-cached) read those
blocks once between them. A prefix kernel holds the query heads of many rows in one tile
(rows x GROUP of one KV head) and writes their partial over the shared tokens into one more
split slot; the decode kernel starts those rows past the prefix (``context_start``), and the
merge folds the prefix slot in.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.cascade import runs_cascade
from kernels.online_softmax import (
    LOG2_E,
    MIN_DOT_DIM,
    TILE_N,
    attend_paged_tiles,
    block_d,
    cache_strides,
    check_paged_attention_args,
    dot_config,
    normalise,
)

MIN_PARTITION_TOKENS = 256  # shorter partitions cost more in merging than they gain
PREFIX_BLOCK_M = 64  # (row, query head) pairs per program of the shared-prefix kernel
PROGRAMS_PER_SM = 8  # enough resident programs per SM to keep HBM busy


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim], written when not SPLIT
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, when SPLIT
    partial_m_ptr,  # [num_seqs, num_heads, num_splits] fp32, when SPLIT
    partial_l_ptr,  # [num_seqs, num_heads, num_splits] fp32, partial_m's layout, when SPLIT
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    context_start_ptr,  # [num_seqs] int32, first key token this kernel reads, when CASCADE
    qk_scale,
    partition_size,  # key tokens per split, a multiple of TILE_N
    stride_out_seq,
    stride_out_head,
    stride_partial_acc_seq,
    stride_partial_acc_head,
    stride_partial_acc_split,
    stride_partial_m_seq,
    stride_partial_m_head,
    stride_query_seq,
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
    SPLIT: tl.constexpr,
    CASCADE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if CASCADE:  # rows of the shared prefix start past it: the prefix kernel read it
        start += tl.load(context_start_ptr + seq)
    if split > 0 and start >= seq_len:
        return  # this sequence is shorter than the split; the merge ignores the slot
    # Split 0 always runs, so that an empty sequence (seq_len 0) still gets its zeros written.
    end = tl.minimum(start + partition_size, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    heads = kv_head * GROUP + offs_m  # [BLOCK_M]
    q = tl.load(
        query_ptr + seq * stride_query_seq + heads[:, None] * stride_query_head + offs_d[None, :],
        mask=mask_md,
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    query_pos = tl.full([BLOCK_M], 0, tl.int32) + (seq_len - 1)
    acc, m_i, l_i = attend_paged_tiles(
        q,
        query_pos,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + seq * stride_block_tables_seq,
        kv_head,
        start,
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

    if SPLIT:
        partial_acc_offs = (
            seq * stride_partial_acc_seq
            + heads[:, None] * stride_partial_acc_head
            + split * stride_partial_acc_split
            + offs_d[None, :]
        )
        tl.store(partial_acc_ptr + partial_acc_offs, acc, mask=mask_md)
        partial_ml_offs = seq * stride_partial_m_seq + heads * stride_partial_m_head + split
        tl.store(partial_m_ptr + partial_ml_offs, m_i, mask=mask_m)
        tl.store(partial_l_ptr + partial_ml_offs, l_i, mask=mask_m)
    else:
        out = normalise(acc, l_i)
        out_offs = seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


@triton.jit
def _paged_decode_merge_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    partial_m_ptr,  # [num_seqs, num_heads, num_splits] fp32
    partial_l_ptr,  # [num_seqs, num_heads, num_splits] fp32, partial_m's layout
    seq_lens_ptr,  # [num_seqs] int32
    context_start_ptr,  # [num_seqs] int32, when CASCADE: > 0 for the rows of the prefix slot
    partition_size,
    prefix_slot,  # the split slot holding the shared prefix's partial, when CASCADE
    stride_out_seq,
    stride_out_head,
    stride_partial_acc_seq,
    stride_partial_acc_head,
    stride_partial_acc_split,
    stride_partial_m_seq,
    stride_partial_m_head,
    HEAD_DIM: tl.constexpr,
    CASCADE: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = 0
    if CASCADE:
        context_start = tl.load(context_start_ptr + seq)
    # The splits this sequence wrote: split 0 always (an empty sequence's m = -inf, l = 0).
    num_splits = tl.maximum(tl.cdiv(seq_len - context_start, partition_size), 1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    if CASCADE:  # and the prefix slot, for the rows that have one
        mask_s = mask_s | (offs_s == tl.where(context_start > 0, prefix_slot, -1))
    mask_d = offs_d < HEAD_DIM

    partial_ml_offs = seq * stride_partial_m_seq + head * stride_partial_m_head + offs_s
    m = tl.load(partial_m_ptr + partial_ml_offs, mask=mask_s, other=float("-inf"))
    l_s = tl.load(partial_l_ptr + partial_ml_offs, mask=mask_s, other=0.0)  # [BLOCK_SPLITS]
    m_max = tl.max(m, 0)  # finite unless the sequence is empty
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for empty splits
    partial_acc_offs = (
        seq * stride_partial_acc_seq
        + head * stride_partial_acc_head
        + offs_s[:, None] * stride_partial_acc_split
        + offs_d[None, :]
    )
    acc = tl.load(
        partial_acc_ptr + partial_acc_offs, mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )  # [BLOCK_SPLITS, BLOCK_D]
    l_sum = tl.sum(l_s * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)  # [BLOCK_D]
    out_offs = seq * stride_out_seq + head * stride_out_head + offs_d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _shared_prefix_kernel(
    partial_acc_ptr,  # [num_seqs, num_heads, num_slots, head_dim] fp32
    partial_m_ptr,  # [num_seqs, num_heads, num_slots] fp32
    partial_l_ptr,  # [num_seqs, num_heads, num_slots] fp32, partial_m's layout
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    rows_ptr,  # [num_rows] int64, the sequences that share the prefix
    num_rows,
    prefix_len,  # shared key tokens, whole blocks
    prefix_slot,
    qk_scale,
    stride_partial_acc_seq,
    stride_partial_acc_head,
    stride_partial_acc_split,
    stride_partial_m_seq,
    stride_partial_m_head,
    stride_query_seq,
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
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program: one KV head, BLOCK_M of the (row, query head of the group) pairs.
    kv_head = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < num_rows * GROUP
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    seqs = tl.load(rows_ptr + offs_m // GROUP, mask=mask_m, other=0)  # [BLOCK_M]
    heads = kv_head * GROUP + offs_m % GROUP
    q = tl.load(
        query_ptr + seqs[:, None] * stride_query_seq + heads[:, None] * stride_query_head
        + offs_d[None, :],
        mask=mask_md,
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    query_pos = tl.full([BLOCK_M], 0, tl.int32) + prefix_len  # every prefix key is visible
    first_row = tl.load(rows_ptr)  # any sharing row's table lists the prefix blocks
    acc, m_i, l_i = attend_paged_tiles(
        q,
        query_pos,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + first_row * stride_block_tables_seq,
        kv_head,
        0,
        prefix_len,
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
    partial_acc_offs = (
        seqs[:, None] * stride_partial_acc_seq
        + heads[:, None] * stride_partial_acc_head
        + prefix_slot * stride_partial_acc_split
        + offs_d[None, :]
    )
    tl.store(partial_acc_ptr + partial_acc_offs, acc, mask=mask_md)
    partial_ml_offs = seqs * stride_partial_m_seq + heads * stride_partial_m_head + prefix_slot
    tl.store(partial_m_ptr + partial_ml_offs, m_i, mask=mask_m)
    tl.store(partial_l_ptr + partial_ml_offs, l_i, mask=mask_m)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one "SM", splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence so that a few long sequences still fill every SM."""
    wanted = triton.cdiv(num_sms * PROGRAMS_PER_SM, max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_context, MIN_PARTITION_TOKENS)))


def _launch_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # tests pass a poisoned one to see every element written
    prefix: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, out)
    # The largest context the block tables can describe: a bound known without a device sync.
    max_context = block_tables.shape[1] * block_size
    if num_seqs == 0:
        return out
    if max_context == 0:  # no block to read, so every seq_len is 0 (see the precondition)
        return out.zero_()

    group = num_heads // num_kv_heads
    rows, shared = prefix if prefix is not None else (None, 0)
    cascade = rows is not None and runs_cascade(len(rows), shared, block_size)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context, _num_sms(out.device))
    partition_size = triton.cdiv(triton.cdiv(max_context, num_splits), TILE_N) * TILE_N
    num_splits = triton.cdiv(max_context, partition_size)
    split = num_splits > 1 or cascade  # the cascade's prefix partial needs the merge
    num_slots = num_splits + int(cascade)  # the prefix's partial in the last slot
    if split:
        partial_acc = out.new_empty(num_seqs, num_heads, num_slots, head_dim, dtype=torch.float32)
        partial_m = out.new_empty(num_seqs, num_heads, num_slots, dtype=torch.float32)
        partial_l = torch.empty_like(partial_m)
    else:  # unused by the kernel; any fp32 tensors will do
        partial_acc = partial_m = partial_l = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
    dot_dtype, dot_precision = dot_config(query.dtype)
    # stride_partial_{acc_seq,acc_head,acc_split,m_seq,m_head}, as every kernel here takes them
    partial_strides = (*partial_acc.stride()[:3], *partial_m.stride()[:2])
    # The constexprs the decode and shared-prefix kernels share (their tile loops').
    tiles = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=block_d(head_dim),
                 TILE_N=TILE_N, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision)
    context_start = seq_lens  # unused without the cascade
    if cascade:
        assert rows is not None
        prefix_len = shared * block_size
        context_start = torch.zeros_like(seq_lens).index_fill_(0, rows, prefix_len)
        prefix_rows = len(rows) * group
        block_m = max(MIN_DOT_DIM, min(PREFIX_BLOCK_M, triton.next_power_of_2(prefix_rows)))
        _shared_prefix_kernel[(num_kv_heads, triton.cdiv(prefix_rows, block_m))](
            partial_acc,
            partial_m,
            partial_l,
            query,
            key_cache,
            value_cache,
            block_tables,
            rows,
            len(rows),
            prefix_len,
            num_splits,
            scale * LOG2_E,
            *partial_strides,
            query.stride(0),
            query.stride(1),
            *cache_strides(key_cache, value_cache),
            block_tables.stride(0),
            BLOCK_M=block_m,
            **tiles,
        )

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        partial_acc,
        partial_m,
        partial_l,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        context_start,
        scale * LOG2_E,
        partition_size,
        out.stride(0),
        out.stride(1),
        *partial_strides,
        query.stride(0),
        query.stride(1),
        *cache_strides(key_cache, value_cache),
        block_tables.stride(0),
        SPLIT=split,
        CASCADE=cascade,
        BLOCK_M=max(MIN_DOT_DIM, triton.next_power_of_2(group)),  # rows past GROUP: padding
        **tiles,
    )
    if split:
        _paged_decode_merge_kernel[(num_seqs, num_heads)](
            out,
            partial_acc,
            partial_m,
            partial_l,
            seq_lens,
            context_start,
            partition_size,
            num_splits,
            out.stride(0),
            out.stride(1),
            *partial_strides,
            HEAD_DIM=head_dim,
            CASCADE=cascade,
            BLOCK_SPLITS=triton.next_power_of_2(num_slots),
            BLOCK_D=block_d(head_dim),
        )
    return out


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new token
    scale: float,
    prefix: tuple[torch.Tensor, int] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new token per sequence over its whole paged context.

    Args:
        query: the new token's query heads; fp16, bf16 or fp32, the cache's dtype.
        key_cache, value_cache: the block pool of one layer, new tokens already written.
        block_tables: logical block -> physical block, per sequence; rows may be padded.
            Each row must cover its sequence: ``seq_len <= block_tables.shape[1] * block_size``
            (not checked: it would cost a device sync).
        seq_lens: context length per sequence, including the new token; a sequence of length 0
            (the engine never sends one) gets zeros.
        scale: the softmax scale, usually ``head_dim ** -0.5``.
        prefix: ``(rows, num_blocks)``: the rows (an int64 tensor on the query's device) whose
            tables start with the same ``num_blocks`` blocks, each row's ``seq_len`` past them
            (``kernels.cascade.shared_prefix``). Those blocks are then read once for all the
            rows (cascade) when ``kernels.cascade.runs_cascade`` says so.
        num_splits: partitions of each row's context (split-K); by default as many as fill
            the SMs, which depends on the number of rows and the longest context. 1 reads each
            row whole in one order whatever the batch (the batch-invariant mode).

    Returns:
        The attention output, in the query's dtype (accumulated in fp32).
    """
    return _launch_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                num_splits=num_splits, prefix=prefix)
