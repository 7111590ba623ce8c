"""Block pool and KV cache manager: allocation, ref counts, eviction order, prefix hits, CoW."""

from __future__ import annotations

import time

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager, hash_block
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 16


def make_seq(tokens: list[int], salt: str | None = None, n: int = 1) -> Sequence:
    return Sequence(
        request_id="r",
        prompt_token_ids=tokens,
        params=SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0),
        metrics=RequestMetrics(arrival_time=time.monotonic()),
        cache_salt=salt,
    )


def test_pool_allocates_in_order_and_frees_to_the_tail() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])
    # Blocks 2, 3 were never used, then 1 and 0 in the order they were freed.
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(1)


def test_pool_refcount_never_negative() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.ref_counts[b] == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_pool_lazy_eviction_keeps_hash_until_reuse() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"h-a")
    pool.free([a, b])
    assert pool.lookup(b"h-a") == a  # freed but still cached
    pool.touch([a])  # a prefix hit revives it
    assert pool.num_free_blocks == 1 and pool.ref_counts[a] == 1
    pool.free([a])
    # Free queue is now [b, a]: b goes first, a keeps its hash until it is handed out.
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"h-a") == a
    assert pool.allocate(1) == [a]
    assert pool.lookup(b"h-a") is None and pool.block_hash[a] is None


@pytest.mark.parametrize(
    ("num_tokens", "blocks", "hashes"),
    [(1, 1, 0), (15, 1, 0), (16, 1, 1), (17, 2, 1), (32, 2, 2), (33, 3, 2)],
)
def test_allocation_at_block_boundaries(num_tokens: int, blocks: int, hashes: int) -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    seq = make_seq(list(range(num_tokens)))
    assert kv.num_blocks_needed(seq, num_tokens) == blocks
    kv.allocate_slots(seq, num_tokens)
    assert len(seq.block_table) == blocks
    assert seq.num_cached_blocks == hashes  # full blocks registered at schedule time
    assert len(kv.pool.cached) == hashes


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_blocks"),
    # At least the last token is always recomputed, so a prompt of exactly k full blocks
    # hits k - 1 of them.
    [(15, 0), (16, 0), (17, 1), (32, 1), (33, 2), (48, 2), (49, 3)],
)
def test_prefix_hits_leave_the_last_token(prompt_len: int, expected_hit_blocks: int) -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    first = make_seq(list(range(prompt_len)))
    kv.allocate_slots(first, prompt_len)
    second = make_seq(list(range(prompt_len)))
    hits = kv.find_cached_prefix(second)
    assert hits == first.block_table[:expected_hit_blocks]


def test_hash_chain_depends_on_parent_and_salt() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_seq(list(range(40)))
    kv.allocate_slots(a, 40)
    salted = make_seq(list(range(40)), salt="tenant-2")
    assert kv.find_cached_prefix(salted) == []
    # Same second block, different first block: no hit on block 1 either (chain hash).
    b = make_seq([99] * 16 + list(range(16, 40)))
    assert kv.find_cached_prefix(b) == []
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


def test_hit_blocks_held_by_others_are_shared_and_free_ones_revived() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = make_seq(list(range(40)))
    kv.allocate_slots(a, 40)  # 3 blocks, 2 full and registered
    b = make_seq(list(range(40)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    # 8 tokens left need 1 new block; the hits are held by `a`, so they cost nothing.
    assert kv.num_blocks_needed(b, 8, hits) == 1
    kv.allocate_slots(b, 8, hits)
    assert [kv.pool.ref_counts[x] for x in hits] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 6
    c = make_seq(list(range(40)))
    hits = kv.find_cached_prefix(c)
    assert len(hits) == 2  # still cached after both were freed (lazy eviction)
    assert kv.num_blocks_needed(c, 8, hits) == 3  # reviving 2 free blocks + 1 new


def test_fork_shares_blocks_and_copies_on_write() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    parent = make_seq(list(range(20)), n=3)
    kv.allocate_slots(parent, 20)
    parent.num_computed_tokens = 20
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
    full, partial = parent.block_table
    assert kv.pool.ref_counts[full] == 3 and kv.pool.ref_counts[partial] == 3

    for seq in (parent, *children):
        seq.token_ids.append(100 + seq.index)
    # First writer copies the shared partial block; the full block stays shared.
    assert kv.num_blocks_needed(parent, 1) == 1
    kv.allocate_slots(parent, 1)
    assert parent.block_table[0] == full and parent.block_table[1] != partial
    assert kv.take_copies() == [(partial, parent.block_table[1])]
    kv.allocate_slots(children[0], 1)
    assert kv.take_copies() == [(partial, children[0].block_table[1])]
    # The last holder writes in place: no copy.
    assert kv.num_blocks_needed(children[1], 1) == 0
    kv.allocate_slots(children[1], 1)
    assert children[1].block_table[1] == partial and kv.take_copies() == []
    assert kv.pool.ref_counts[full] == 3
    for seq in (parent, *children):
        kv.free(seq)
    assert kv.pool.num_free_blocks == 8
    assert all(r == 0 for r in kv.pool.ref_counts)
