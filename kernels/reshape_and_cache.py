"""Triton ``reshape_and_cache``: scatter new K/V tokens into their slots of the paged block pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.online_softmax import cache_strides


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, block * block_size + offset; < 0 = padding
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_key_cache_block,
    stride_key_cache_token,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_token,
    stride_value_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr
        + token * stride_value_token
        + offs_h[:, None] * stride_value_head
        + offs_d[None, :],
        mask=mask,
    )
    key_cache_offs = (
        block * stride_key_cache_block
        + offset * stride_key_cache_token
        + offs_h[:, None] * stride_key_cache_head
        + offs_d[None, :]
    )
    value_cache_offs = (
        block * stride_value_cache_block
        + offset * stride_value_cache_token
        + offs_h[:, None] * stride_value_cache_head
        + offs_d[None, :]
    )
    tl.store(key_cache_ptr + key_cache_offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + value_cache_offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _launch_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    assert value.shape == key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and value_cache.shape == key_cache.shape
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert slot_mapping.is_contiguous()
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the kernel assumes a unit stride along head_dim"
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *cache_strides(key_cache, value_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = padding (skipped)
) -> None:
    """Write each token's K and V into its physical slot of the block pool, in place.

    Args:
        key, value: the new tokens' K and V; any dtype, cast to the cache's dtype.
        key_cache, value_cache: the block pool of one layer; only the slots named are written.
        slot_mapping: ``physical_block * block_size + offset`` per token; negative entries are
            padding tokens and leave the cache untouched.
    """
    _launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
