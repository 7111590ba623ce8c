"""KV cache bookkeeping the allocator tests leave out: after a failed step, the prefix cache
forgets the blocks only the failed sequence held and keeps those others share; a swap round
trip leaves each sequence in exactly one pool; a freed sequence holds no cached blocks; the
block hash is the SHA-256 chain its docstring defines."""

from __future__ import annotations

import hashlib
import time
from array import array

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager, hash_block
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=tokens, params=SamplingParams(),
                    metrics=RequestMetrics(arrival_time=time.monotonic()))


def test_pool_forgets_only_blocks_held_once() -> None:
    pool = BlockPool(4)
    alone, shared, unheld = pool.allocate(3)
    pool.touch([shared])  # ref counts: 1, 2, 1
    for block, h in ((alone, b"a"), (shared, b"s"), (unheld, b"u")):
        pool.register(block, h)
    pool.free([unheld])  # ref count 0: cached, in the free queue
    pool.forget([alone, shared, unheld])
    assert pool.lookup(b"a") is None and pool.block_hash[alone] is None
    assert pool.lookup(b"s") == shared and pool.block_hash[shared] == b"s"
    assert pool.lookup(b"u") == unheld


def test_a_failed_sequence_leaves_the_prefix_blocks_it_shares() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    first = make_seq(list(range(10)))
    kv.allocate_slots(first, 10)  # blocks 0, 1 full and registered
    failed = make_seq([*range(8), 50, 51, 52, 53, 54])
    hits = kv.find_cached_prefix(failed)
    assert hits == first.block_table[:2]
    kv.allocate_slots(failed, 5, hits)
    failed.num_computed_tokens = 8
    own = failed.block_table[2]  # [50..53], registered and held by `failed` alone
    assert kv.pool.block_hash[own] is not None
    kv.forget(failed)
    kv.free(failed)
    assert kv.pool.block_hash[own] is None
    again = make_seq([*range(8), 50, 51, 52, 53, 54])
    assert kv.find_cached_prefix(again) == first.block_table[:2]


def test_a_swap_round_trip_leaves_the_sequence_in_one_pool() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=False, num_host_blocks=4)
    seq = make_seq(list(range(10)))
    kv.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    device = list(seq.block_table)
    copies_out = kv.swap_out(seq)
    assert seq.block_table == [] and len(seq.host_block_table) == 3
    assert copies_out == list(zip(device, seq.host_block_table, strict=True))
    host = list(seq.host_block_table)
    copies_in = kv.swap_in(seq)
    assert seq.host_block_table == [] and len(seq.block_table) == 3
    assert copies_in == list(zip(host, seq.block_table, strict=True))
    assert kv.host_pool is not None and kv.host_pool.num_free_blocks == 4
    assert kv.pool.num_free_blocks == 1


def test_swap_in_takes_from_the_prefix_cache_only_blocks_already_computed() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, num_host_blocks=4)
    tokens = list(range(10))
    partial = make_seq(tokens)
    kv.allocate_slots(partial, 2)  # a first chunk of 2 tokens: block 0 not full yet
    partial.num_computed_tokens = 2
    full = make_seq(tokens)
    kv.allocate_slots(full, 10)  # registers blocks [0, 4) and [4, 8) of the same tokens
    ((_, host_block),) = kv.swap_out(partial)
    copies = kv.swap_in(partial)
    # Its 2 computed tokens come back from the host; the cached blocks are for later chunks.
    assert [src for src, _ in copies] == [host_block] and len(partial.block_table) == 1
    assert partial.block_table[0] not in full.block_table


def test_usage_is_the_fraction_of_blocks_held() -> None:
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    pool.allocate(1)
    assert pool.usage() == 0.25
    pool.allocate(3)
    assert pool.usage() == 1.0


def test_a_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 1, got 0$"):
        BlockPool(0)


def test_without_host_blocks_there_is_no_swap() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    seq = make_seq([1, 2])
    kv.allocate_slots(seq, 2)
    assert kv.host_pool is None and not kv.can_swap_out(seq)


def test_the_block_hash_is_a_sha256_chain() -> None:
    tokens = array("q", [1, 2, 3]).tobytes()  # int64, native order
    first = hash_block(None, [1, 2, 3])
    assert first == hashlib.sha256(b"\0" + tokens).digest()
    assert hash_block(first, [1, 2, 3], b"salt") == hashlib.sha256(
        first + tokens + b"salt").digest()


def test_a_freed_sequence_holds_no_cached_blocks() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    seq = make_seq(list(range(9)))
    kv.allocate_slots(seq, 9)
    assert seq.num_cached_blocks == 2
    kv.free(seq)
    assert (seq.block_table, seq.num_cached_blocks) == ([], 0)
