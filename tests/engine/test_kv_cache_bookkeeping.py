"""KV cache bookkeeping the allocator tests leave out: after a failed step, the prefix cache
forgets the blocks only the failed sequence held and keeps those others share; a swap round
trip leaves each sequence in exactly one pool."""

from __future__ import annotations

import time

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager
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
