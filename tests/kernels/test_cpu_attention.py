"""The CPU ops (kernels/cpu.py, native decode) against the reference on awkward paged batches."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from kernel_cases import BLOCK_SIZES, CASCADE_SEQS, HEAD_DIMS, HEADS, share_prefix

from kernels import cpu, reference
from kernels.native import cache_dir

# (seq_len, q_len) per sequence.
DECODE_SEQS = [(1, 1), (15, 1), (16, 1), (17, 1), (333, 1), (40, 1)]
PREFILL_SEQS = [(1, 1), (15, 15), (16, 16), (17, 17), (333, 77), (40, 1), (150, 150), (9, 0)]
SHAPES = [
    pytest.param(d, bs, h, id=f"d{d}-bs{bs}-h{h[0]}kv{h[1]}")
    for d, bs, h in itertools.product(HEAD_DIMS, BLOCK_SIZES, HEADS)
]


def _args(batch, decode: bool) -> tuple:
    if decode:
        return (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                batch.seq_lens, batch.query.shape[2] ** -0.5)
    return (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.query.shape[2] ** -0.5)


@pytest.mark.parametrize(("head_dim", "block_size", "heads"), SHAPES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_fp32_matches_reference(cpu_paged_batch, assert_matches, head_dim, block_size, heads,
                                decode) -> None:
    batch = cpu_paged_batch(DECODE_SEQS if decode else PREFILL_SEQS, num_heads=heads[0],
                        num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    args = _args(batch, decode)
    if decode:
        assert_matches(cpu.paged_attention_decode(*args), reference.paged_attention_decode(*args))
    else:
        out = cpu.paged_attention_prefill(*args)
        assert_matches(out, reference.paged_attention_prefill(*args))


@pytest.mark.parametrize("limit", [0, 1 << 40], ids=["head-by-head", "folded"])
def test_prefill_after_a_prefix_folded_or_head_by_head(cpu_paged_batch, assert_matches,
                                                       monkeypatch, limit: int) -> None:
    # A chunk after a cached prefix folds each KV head's query heads into its rows up to
    # FOLDED_MASK_MAX mask elements and goes head by head past it: both the reference's values.
    monkeypatch.setattr(cpu, "FOLDED_MASK_MAX", limit)
    batch = cpu_paged_batch(PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_dim=32,
                            block_size=16)
    args = _args(batch, decode=False)
    assert_matches(cpu.paged_attention_prefill(*args), reference.paged_attention_prefill(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_half_precision_matches_reference(cpu_paged_batch, assert_matches, dtype, decode) -> None:
    batch = cpu_paged_batch(DECODE_SEQS if decode else PREFILL_SEQS, num_heads=9, num_kv_heads=3,
                        head_dim=64, block_size=16, dtype=dtype)
    args = _args(batch, decode)
    op = cpu.paged_attention_decode if decode else cpu.paged_attention_prefill
    ref = reference.paged_attention_decode if decode else reference.paged_attention_prefill
    assert_matches(op(*args), ref(*args))


# Shared-prefix (cascade) decode: rows whose block tables start with the same blocks.
@pytest.mark.parametrize(("head_dim", "block_size", "heads"), [
    pytest.param(64, 16, (9, 3), id="d64-bs16-h9kv3"),
    pytest.param(13, 32, (8, 1), id="d13-bs32-h8kv1"),
    pytest.param(80, 16, (4, 4), id="d80-bs16-h4kv4"),
])
@pytest.mark.parametrize("sharing", ["all", "some"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# scattered: the prefix's blocks are gathered; consecutive (one prompt's prefill): viewed
@pytest.mark.parametrize("layout", ["scattered", "consecutive"])
def test_cascade_decode_over_shared_prefix_blocks(cpu_paged_batch, assert_matches, head_dim,
                                                   block_size, heads, sharing, dtype,
                                                   layout) -> None:
    batch = cpu_paged_batch(CASCADE_SEQS, num_heads=heads[0], num_kv_heads=heads[1],
                        head_dim=head_dim, block_size=block_size, dtype=dtype)
    sharers = list(range(len(CASCADE_SEQS))) if sharing == "all" else [0, 2, 3, 5]
    tables, prefix = share_prefix(batch.block_tables, batch.seq_lens, block_size, sharers,
                                  consecutive=layout == "consecutive")
    args = (batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens,
            head_dim**-0.5)
    expected = reference.paged_attention_decode(*args)
    assert_matches(cpu.paged_attention_decode(*args), expected)
    # As the engine calls it, with the prefix found once per step.
    assert_matches(cpu.paged_attention_decode(*args, prefix=prefix), expected)


@pytest.mark.parametrize("seqs", [[(1, 1)], [(333, 1)], [(16, 1), (17, 1)]],
                         ids=["one-token", "one-seq", "two-seqs"])
def test_decode_of_tiny_batches(cpu_paged_batch, assert_matches, seqs) -> None:
    batch = cpu_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    args = _args(batch, decode=True)
    assert_matches(cpu.paged_attention_decode(*args), reference.paged_attention_decode(*args))


@pytest.mark.parametrize("threads", [3, 4])
def test_split_decode_of_fewer_sequences_than_threads(cpu_paged_batch, assert_matches,
                                                      threads) -> None:
    # Each sequence is cut into runs of blocks (2 or 3 parts), merged after; with the cascade,
    # only the first part starts from the prefix's attention.
    seqs = [(150, 1), (97, 1)]
    batch = cpu_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    tables, prefix = share_prefix(batch.block_tables, batch.seq_lens, 16, [0, 1])
    args = (batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens, 0.125)
    lone_args = (batch.query[:1], batch.key_cache, batch.value_cache, tables[:1],
                 batch.seq_lens[:1], 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lone = cpu.paged_attention_decode(*lone_args)
        shared = cpu.paged_attention_decode(*args, prefix=prefix)
    finally:
        torch.set_num_threads(before)
    assert_matches(lone, reference.paged_attention_decode(*lone_args))
    assert_matches(shared, reference.paged_attention_decode(*args))


def test_decode_kernel_is_built_once_per_cpu_and_refuses_other_dtypes() -> None:
    from kernels import native

    built = Path(native.library("cpu_decode")._name)
    assert built.parent == cache_dir() / "kernels"
    stamp = built.stat().st_mtime_ns
    native.library.cache_clear()  # a new process: it finds the file and does not rebuild
    assert Path(native.library("cpu_decode")._name) == built
    assert built.stat().st_mtime_ns == stamp
    cache = torch.zeros(4, 16, 1, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"no CPU decode kernel for a torch\.float64"):
        native.paged_decode(torch.zeros(1, 1, 8), cache, cache,
                            torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), 1.0)
