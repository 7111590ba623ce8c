"""Paged decode against the reference, single-pass, split-K and cascade, on awkward shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import BLOCK_SIZES, CASCADE_SEQS, HEAD_DIMS, HEADS, share_prefix

from kernels import reference
from kernels.paged_decode import (
    _launch_paged_decode,
    default_num_splits,
    paged_attention_decode,
)

# Context lengths around block boundaries, plus a long one that spans several splits.
SEQ_LENS = [1, 15, 16, 17, 333]


def run_decode(batch, num_splits):
    head_dim = batch.query.shape[2]
    scale = head_dim**-0.5
    poisoned = torch.full_like(batch.query, float("nan"))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    out = _launch_paged_decode(*args, scale, num_splits=num_splits, out=poisoned)
    return out, reference.paged_attention_decode(*args, scale)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "heads", "num_splits"),
    [
        pytest.param(d, bs, h, n, id=f"d{d}-bs{bs}-h{h[0]}kv{h[1]}-splits{n}")
        for d, bs, h, n in itertools.product(HEAD_DIMS, BLOCK_SIZES, HEADS, [1, 3])
    ],
)
def test_fp32_matches_reference(
    paged_batch, assert_matches, head_dim, block_size, heads, num_splits
):
    num_heads, num_kv_heads = heads
    batch = paged_batch(
        [(n, 1) for n in SEQ_LENS],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    assert_matches(*run_decode(batch, num_splits))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_half_precision_matches_reference(paged_batch, assert_matches, dtype, num_splits):
    batch = paged_batch(
        [(n, 1) for n in SEQ_LENS],
        num_heads=9,
        num_kv_heads=3,
        head_dim=80,
        block_size=16,
        dtype=dtype,
    )
    assert_matches(*run_decode(batch, num_splits))


def test_more_splits_than_a_short_sequence_needs(paged_batch, assert_matches):
    # Splits past a sequence's end write nothing; the merge must ignore their slots.
    batch = paged_batch(
        [(1, 1), (70, 1), (200, 1)], num_heads=2, num_kv_heads=1, head_dim=10, block_size=16
    )
    assert_matches(*run_decode(batch, num_splits=8))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_sequence_gets_zeros(paged_batch, assert_matches, num_splits):
    batch = paged_batch(
        [(17, 1), (70, 1), (200, 1)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=16
    )
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = 0  # the engine never sends one; the kernel must still not leave garbage
    scale = 0.25
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, seq_lens)
    poisoned = torch.full_like(batch.query, float("nan"))
    out = _launch_paged_decode(*args, scale, num_splits=num_splits, out=poisoned)
    ref = reference.paged_attention_decode(*args, scale)
    assert_matches(out[[0, 2]], ref[[0, 2]])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize(
    ("head_dim", "block_size", "heads", "sharing", "num_splits"),
    [
        pytest.param(64, 16, (9, 3), "all", 1, id="d64-bs16-h9kv3-all"),
        pytest.param(13, 32, (8, 1), "some", 1, id="d13-bs32-h8kv1-some"),
        pytest.param(80, 16, (4, 4), "some", 3, id="d80-bs16-h4kv4-some-splits3"),
    ],
)
def test_cascade_matches_reference(paged_batch, assert_matches, head_dim, block_size, heads,
                                   sharing, num_splits):
    batch = paged_batch(CASCADE_SEQS, num_heads=heads[0], num_kv_heads=heads[1],
                        head_dim=head_dim, block_size=block_size)
    sharers = list(range(len(CASCADE_SEQS))) if sharing == "all" else [0, 2, 3, 5]
    tables, prefix = share_prefix(batch.block_tables, batch.seq_lens, block_size, sharers)
    args = (batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens)
    poisoned = torch.full_like(batch.query, float("nan"))
    out = _launch_paged_decode(*args, head_dim**-0.5, num_splits=num_splits, out=poisoned,
                               prefix=prefix)
    assert_matches(out, reference.paged_attention_decode(*args, head_dim**-0.5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_in_half_precision_over_several_row_tiles(paged_batch, assert_matches, dtype):
    # 12 rows of GQA 8: 96 (row, head) pairs, two tiles of the prefix kernel.
    seqs = [(100 + 7 * i, 1) for i in range(12)]
    batch = paged_batch(seqs, num_heads=8, num_kv_heads=1, head_dim=16, block_size=16,
                        dtype=dtype)
    tables, prefix = share_prefix(batch.block_tables, batch.seq_lens, 16, list(range(12)))
    args = (batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens, 0.25)
    out = paged_attention_decode(*args, prefix=prefix)
    assert_matches(out, reference.paged_attention_decode(*args))


def test_block_tables_without_columns():
    query = torch.full((2, 4, 16), float("nan"))
    cache = torch.zeros(3, 16, 2, 16)
    block_tables = torch.zeros(2, 0, dtype=torch.int32)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    out = _launch_paged_decode(query, cache, cache, block_tables, seq_lens, 0.25, out=query.clone())
    assert torch.equal(out, torch.zeros_like(out))


def test_poison_shows_a_read_one_slot_too_far(paged_batch, assert_matches):
    # The poisoned slots must make any kernel that reads them fail: here the reference itself,
    # told each sequence is one token longer, must miss the tolerance on every sequence.
    batch = paged_batch(
        [(n, 1) for n in SEQ_LENS], num_heads=9, num_kv_heads=3, head_dim=16, block_size=16
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables)
    right = reference.paged_attention_decode(*args, batch.seq_lens, 0.25)
    wrong = reference.paged_attention_decode(*args, batch.seq_lens + 1, 0.25)
    for i in range(len(SEQ_LENS)):
        with pytest.raises(AssertionError):
            assert_matches(wrong[i], right[i])


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_context", "num_sms", "expected"),
    [
        (1, 8, 8192, 132, 32),  # one long sequence: split up to the minimum partition
        (16, 8, 8192, 132, 9),  # a few long sequences: enough programs to fill the SMs
        (256, 8, 8192, 132, 1),  # a big batch fills the GPU by itself
        (1, 8, 100, 132, 1),  # a short context is never split
    ],
)
def test_default_num_splits(num_seqs, num_kv_heads, max_context, num_sms, expected):
    assert default_num_splits(num_seqs, num_kv_heads, max_context, num_sms) == expected
