"""KV cache bookkeeping the allocator tests leave out: after a failed step, the prefix cache
forgets the blocks only the failed sequence held and keeps those others share."""

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
