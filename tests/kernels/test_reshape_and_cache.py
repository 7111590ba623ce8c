"""``reshape_and_cache`` against the reference: the whole pool is compared, not only the slots."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.reshape_and_cache import reshape_and_cache

# (num_kv_heads, head_dim, block_size, cache dtype); the new K/V are always fp32.
CASES = [
    (1, 64, 16, torch.float32),
    (3, 80, 16, torch.float32),
    (2, 13, 32, torch.float32),
    (8, 64, 32, torch.float16),
    (3, 80, 16, torch.bfloat16),
]


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_matches_reference_and_skips_padding(
    paged_batch, num_kv_heads, head_dim, block_size, dtype
):
    # A fresh prefill, a chunk after a cached prefix and a decode, plus padding slots.
    batch = paged_batch(
        [(17, 17), (40, 9), (16, 1)],
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    key, value = batch.key.float(), batch.value.float()
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[[3, 20]] = -1  # padding tokens: their K/V must not land anywhere
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    ref_key_cache, ref_value_cache = batch.key_cache.clone(), batch.value_cache.clone()

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    reference.reshape_and_cache(key, value, ref_key_cache, ref_value_cache, slot_mapping)

    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)
    assert not torch.equal(key_cache, batch.key_cache)  # it wrote something


def test_no_tokens_is_a_no_op(paged_batch):
    batch = paged_batch([(5, 1)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    key_cache = batch.key_cache.clone()
    empty = batch.key[:0]
    reshape_and_cache(empty, empty, key_cache, batch.value_cache, batch.slot_mapping[:0])
    assert torch.equal(key_cache, batch.key_cache)


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_cpu_row_copies_match_reference(cpu_paged_batch, num_kv_heads, head_dim, block_size,
                                        dtype):
    """The CPU op copies rows in C when K/V already have the cache dtype (the engine's case:
    strided views into the qkv projection), and falls back to the reference otherwise."""
    from kernels import cpu

    batch = cpu_paged_batch([(17, 17), (40, 9), (16, 1)], num_heads=num_kv_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                        dtype=dtype)
    tokens = batch.key.shape[0]
    qkv = torch.randn(tokens, 3 * num_kv_heads * head_dim).to(dtype)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[[3, 20]] = -1
    for k, v in ((key, value), (key.float(), value.float())):
        caches = batch.key_cache.clone(), batch.value_cache.clone()
        expected = batch.key_cache.clone(), batch.value_cache.clone()
        cpu.reshape_and_cache(k, v, *caches, slot_mapping)
        reference.reshape_and_cache(k, v, *expected, slot_mapping)
        assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
        assert not torch.equal(caches[0], batch.key_cache)
