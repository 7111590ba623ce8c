"""Paged varlen prefill against the reference: fresh prompts, chunks over a cached prefix."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import BLOCK_SIZES, HEAD_DIMS, HEADS

from kernels import reference
from kernels.paged_prefill import _launch_paged_prefill

# (seq_len, q_len): fresh prompts of 1, 15, 16 and 17 tokens; a chunk of 77 new tokens over a
# 256-token cached prefix (a prefix-cache hit or earlier chunks); a decode-shaped sequence; a
# longer fresh prompt that spans several query blocks.
SEQS = [(1, 1), (15, 15), (16, 16), (17, 17), (333, 77), (40, 1), (150, 150)]


def run_prefill(batch):
    head_dim = batch.query.shape[2]
    scale = head_dim**-0.5
    poisoned = torch.full_like(batch.query, float("nan"))
    args = (
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
    )
    out = _launch_paged_prefill(*args, scale, out=poisoned)
    return out, reference.paged_attention_prefill(*args, scale)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "heads"),
    [
        pytest.param(d, bs, h, id=f"d{d}-bs{bs}-h{h[0]}kv{h[1]}")
        for d, bs, h in itertools.product(HEAD_DIMS, BLOCK_SIZES, HEADS)
    ],
)
def test_fp32_matches_reference(paged_batch, assert_matches, head_dim, block_size, heads):
    num_heads, num_kv_heads = heads
    batch = paged_batch(
        SEQS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    assert_matches(*run_prefill(batch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(paged_batch, assert_matches, dtype):
    # The fp32 sequences less the long fresh prompt: rounding, not the tiling, is under test.
    seqs = [s for s in SEQS if s != (150, 150)]
    batch = paged_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=80, block_size=16, dtype=dtype)
    assert_matches(*run_prefill(batch))


@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(64, 64)], id="one-full-query-block"),
        pytest.param([(5, 0), (20, 3), (9, 0)], id="sequences-without-new-tokens"),
        pytest.param([(3, 1)] * 9, id="many-one-token-sequences"),
    ],
)
def test_query_block_numbering(paged_batch, assert_matches, seqs):
    batch = paged_batch(seqs, num_heads=2, num_kv_heads=2, head_dim=8, block_size=16)
    assert_matches(*run_prefill(batch))
