"""The queue's streams (``jobs.queue``) on a real Redis, value by value: where an enqueue puts
new entries among the waiting ones (and never moves a delivered one), what a merged read and
a stealing read hand out and in which order, the blocking wait, leases and windows, paging
over pending entries, claims of deleted entries and of dead workers' entries, dead letters,
and the done and cancel markers."""

from __future__ import annotations

import json
import time

import pytest
import redis

from jobs.constants import CANCEL_MARKER_TTL_S, CONSUMER_GROUP, DONE_MARKER_TTL_S, Keys
from jobs.queue import STEAL_AFTER_MS, JobQueue, announce_ended, live_adapters, signal_cancel
from jobs.route import PREFIX_KEY_CHARS, bucket_of
from jobs.schemas import JobSpec, JobStatus

LEAD = "x" * PREFIX_KEY_CHARS  # prompts that start with it share one bucket


def _one_bucket(priorities: list[int], tag: str) -> list[JobSpec]:
    """Jobs of one bucket (a shared prompt prefix) with these priorities."""
    return [JobSpec(model="m", prompt=f"{LEAD}{tag}{i}", priority=p)
            for i, p in enumerate(priorities)]


def _spread(n: int, priority: int = 0, tag: str = "s") -> list[JobSpec]:
    """``n`` jobs, each in a bucket of its own."""
    specs: list[JobSpec] = []
    used: set[int] = set()
    i = 0
    while len(specs) < n:
        spec = JobSpec(model="m", prompt=f"{tag}-{i}", priority=priority)
        i += 1
        if bucket_of(spec) not in used:
            used.add(bucket_of(spec))
            specs.append(spec)
    return specs


def _waiting(client: redis.Redis, q: JobQueue, stream: str) -> list[tuple[str, str]]:
    """(entry id, job id) of every entry of ``stream``, in stream order."""
    return [(e, f["id"]) for e, f in client.xrange(stream)]


def _pending(client: redis.Redis, q: JobQueue) -> dict[tuple[str, str], str]:
    """(stream, entry id) -> consumer, over the model's streams."""
    return {(s, p["message_id"]): p["consumer"] for s in q.streams if client.exists(s)
            for p in client.xpending_range(s, CONSUMER_GROUP, "-", "+", 1000)}


def test_an_enqueue_slots_new_jobs_by_priority_among_the_waiting_ones(
        redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    waiting = _one_bucket([3, 3, 6], "w")
    ids = q.enqueue(waiting)
    assert len(ids) == 3
    stream = q.streams[bucket_of(waiting[0])]
    assert _waiting(redis_client, q, stream) == list(zip(ids, [s.id for s in waiting],
                                                         strict=True))
    new = _one_bucket([1, 3, 5, 9], "n")
    new_ids = q.enqueue(new)
    assert len(new_ids) == 4  # the moved entries' new ids are not the new jobs'
    order = [j for _, j in _waiting(redis_client, q, stream)]
    # (priority, arrival): 1n, 3w, 3w, 3n, 5n, 6w, 9n
    assert order == [new[0].id, waiting[0].id, waiting[1].id, new[1].id, new[2].id,
                     waiting[2].id, new[3].id]
    entry_of = {j: e for e, j in _waiting(redis_client, q, stream)}
    assert [entry_of[s.id] for s in new] == new_ids
    got = q.read("w", count=10)
    assert [d.job_id for d in got] == order


def test_equal_priorities_keep_arrival_order_and_their_entries(
        redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    first = _one_bucket([2, 2, 2], "a")
    q.enqueue(first)
    stream = q.streams[bucket_of(first[0])]
    before = _waiting(redis_client, q, stream)
    second = _one_bucket([2, 2], "b")
    q.enqueue(second)
    after = _waiting(redis_client, q, stream)
    assert after[:3] == before  # not worse than the new ones: not moved, same entries
    assert [j for _, j in after[3:]] == [s.id for s in second]
    # A better job moves the waiting ones behind it, in their order.
    better = _one_bucket([0], "c")
    q.enqueue(better)
    assert [j for _, j in _waiting(redis_client, q, stream)] == [better[0].id] + [
        s.id for s in first + second]
    # New jobs of equal priority after moved ones: arrival order throughout.
    mixed = _one_bucket([1, 2, 2], "d")
    q.enqueue(mixed)
    assert [j for _, j in _waiting(redis_client, q, stream)] == [better[0].id, mixed[0].id] + [
        s.id for s in first + second] + [mixed[1].id, mixed[2].id]


def test_a_delivered_entry_is_never_moved_or_delivered_again(
        redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    old = _one_bucket([5, 5, 5], "o")
    q.enqueue(old)
    (held,) = q.read("w1", count=1)
    assert held.job_id == old[0].id
    q.enqueue(_one_bucket([1], "n"))  # better than everything: moves what still waits
    assert _pending(redis_client, q) == {(held.stream, held.entry_id): "w1"}
    assert held.entry_id in {e for e, _ in redis_client.xrange(held.stream)}
    rest = q.read("w2", count=10)
    assert held.job_id not in {d.job_id for d in rest}
    assert len(rest) == 3
    q.ack([held, *rest])
    assert q.depth() == (0, 0) and q.length() == 0


def test_a_merged_read_takes_the_best_across_buckets(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    a, b, c = _spread(3, tag="m")
    specs = [JobSpec(model="m", prompt=a.prompt, priority=7),
             JobSpec(model="m", prompt=b.prompt, priority=2),
             JobSpec(model="m", prompt=c.prompt, priority=4),
             JobSpec(model="m", prompt=b.prompt + " again", priority=4)]
    for spec in specs:
        q.enqueue([spec])
    got = q.read("w", count=2)
    assert [d.job_id for d in got] == [specs[1].id, specs[2].id]
    assert [d.stream for d in got] == [q.streams[bucket_of(s)] for s in specs[1:3]]
    assert q.depth() == (2, 2)
    rest = q.read("w", count=5)
    assert [d.job_id for d in rest] == [specs[3].id, specs[0].id]
    assert q.depth() == (0, 4)
    assert q.read("w", count=5) == []


def test_a_merged_read_orders_by_priority_before_arrival(redis_client: redis.Redis,
                                                         keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    specs = [JobSpec(model="m", prompt=s.prompt, priority=p)
             for s, p in zip(_spread(6, tag="o"), [5, 3, 9, 1, 3, 0], strict=True)]
    for spec in specs:
        q.enqueue([spec])
    got = q.read("w", count=10)
    want = sorted(range(6), key=lambda i: (specs[i].priority, i))
    assert [d.job_id for d in got] == [specs[i].id for i in want]


def test_a_stealing_read_waits_for_entries_to_age(redis_client: redis.Redis,
                                                  keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    started = time.monotonic()
    q.enqueue(_one_bucket([0, 0], "s"))
    early = q.read("thief", count=10, steal=True)
    if early:  # only a machine that stalled past the steal delay (250 ms) sees them already
        assert time.monotonic() - started >= 0.25
    else:
        time.sleep(STEAL_AFTER_MS / 1000 + 0.1)
        assert len(q.read("thief", count=10, steal=True)) == 2
    assert q.read("thief", count=10, steal=True) == []


def test_a_stealing_read_takes_the_best_then_the_fullest_bucket(redis_client: redis.Redis,
                                                                keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    small = _one_bucket([4], "small")
    big = [JobSpec(model="m", prompt=f"{'y' * PREFIX_KEY_CHARS}{i}", priority=4)
           for i in range(3)]
    best = [JobSpec(model="m", prompt=f"{'z' * PREFIX_KEY_CHARS}{i}", priority=1)
            for i in range(2)]
    assert len({bucket_of(small[0]), bucket_of(big[0]), bucket_of(best[0])}) == 3
    q.enqueue(small + big + best)
    # One of big's entries is held already: it waits for nobody, so it does not count.
    q.enqueue([JobSpec(model="m", prompt=f"{'y' * PREFIX_KEY_CHARS}held", priority=0)])
    (held,) = q.read("owner", count=1)
    time.sleep(STEAL_AFTER_MS / 1000 + 0.1)
    got = q.read("thief", count=4, steal=True)
    assert [d.job_id for d in got] == [s.id for s in best] + [big[0].id, big[1].id]
    rest = q.read("thief", count=10, steal=True)
    assert sorted(d.job_id for d in rest) == sorted([big[2].id, small[0].id])
    assert _pending(redis_client, q)[held.stream, held.entry_id] == "owner"


def test_a_stealing_read_counts_only_waiting_entries(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    a = [JobSpec(model="m", prompt=f"{'a' * PREFIX_KEY_CHARS}{i}") for i in range(4)]
    b = [JobSpec(model="m", prompt=f"{'b' * PREFIX_KEY_CHARS}{i}") for i in range(2)]
    assert bucket_of(a[0]) != bucket_of(b[0])
    q.enqueue(a)
    q.read("owner", count=3, buckets=[bucket_of(a[0])])  # a: 4 entries, 1 waiting
    q.enqueue(b)  # b: 2 waiting
    time.sleep(STEAL_AFTER_MS / 1000 + 0.1)
    got = q.read("thief", count=2, steal=True)
    assert [d.job_id for d in got] == [s.id for s in b]


def test_wait_hands_out_one_entry_of_the_buckets_asked(redis_client: redis.Redis,
                                                       keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    # No group yet (as after Redis restarted empty): nothing, and the groups come back.
    assert q.wait("w", block_ms=10) == []
    assert all(redis_client.xinfo_groups(s) for s in q.streams)
    jobs = _one_bucket([0, 0, 0], "w")
    q.enqueue(jobs)
    bucket = bucket_of(jobs[0])
    other = (bucket + 1) % len(q.streams)
    assert q.wait("w", block_ms=50, buckets=[other]) == []
    got = q.wait("w", block_ms=1000, buckets=[bucket])
    assert [d.job_id for d in got] == [jobs[0].id]
    assert [d.job_id for d in q.wait("w", block_ms=1000)] == [jobs[1].id]


def test_wait_hands_out_one_entry_a_stream(redis_client: redis.Redis, keys: Keys) -> None:
    """XREADGROUP's COUNT is per stream: a wait on three buckets that each hold an entry
    returns three (the intake keeps what exceeds its room for its next pull)."""
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    jobs = _spread(3)
    q.enqueue(jobs)
    got = q.wait("w", block_ms=1000, buckets=[bucket_of(j) for j in jobs])
    assert sorted(d.job_id for d in got) == sorted(j.id for j in jobs)


def test_ensure_group_delivers_entries_already_in_the_stream(redis_client: redis.Redis,
                                                             keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    redis_client.xadd(q.streams[3], {"id": "early", "job": "{}"})
    q.ensure_group()
    q.ensure_group()  # again: the groups exist, no error
    (got,) = q.read("w", count=5)
    assert (got.job_id, got.payload) == ("early", "{}")
    assert q.length() == 1


def test_enqueue_refuses_another_models_job(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    with pytest.raises(ValueError, match="not 'm'"):
        q.enqueue([JobSpec(model="m", prompt="ok"), JobSpec(model="other", prompt="no")])
    assert q.length() == 0
    assert q.enqueue([]) == []


def test_heartbeat_window_and_adapters(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    assert q.window(floor=7) == 7  # no live worker
    q.heartbeat("w1", lease_ttl_ms=5000, window=3, adapters=["m:a", "m:b"])
    q.heartbeat("w2", lease_ttl_ms=60_000, window=5)
    assert 0 < redis_client.pttl(keys.heartbeat("w1")) <= 5000
    assert redis_client.get(keys.heartbeat("w1")) == "m"
    assert q.serving() == {"w1": 3, "w2": 5}
    assert q.window(floor=7) == 8
    assert q.live_workers() == {"w1", "w2"}
    assert live_adapters(redis_client, keys) == {"m:a", "m:b"}
    assert redis_client.hget(keys.adapters(), "w2") is None
    q.drop_heartbeat("w1")
    assert not redis_client.exists(keys.heartbeat("w1"))
    assert redis_client.hkeys(keys.feed_windows("m")) == ["w2"]
    assert q.serving() == {"w2": 5} and q.window(floor=7) == 5
    assert live_adapters(redis_client, keys) == set()
    assert q.live_workers() == {"w2"}


def test_own_pending_pages_through_this_consumers_entries_only(redis_client: redis.Redis,
                                                               keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    mine = _one_bucket([0] * 5, "mine")
    q.enqueue(mine)
    held = q.read("me", count=5)
    q.enqueue(_one_bucket([0, 0], "theirs"))
    q.read("other", count=2)
    refs = q.own_pending("me", page_size=2)
    assert refs == [(d.stream, d.entry_id) for d in held]
    assert q.own_pending("me", page_size=5) == refs
    assert q.own_pending("nobody") == []


def test_claiming_a_deleted_entry_acks_it(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    jobs = _one_bucket([0, 0], "c")
    q.enqueue(jobs)
    held = q.read("w1", count=2)
    redis_client.xdel(held[0].stream, held[0].entry_id)  # dropped meanwhile
    claimed, gone = q.claim("w2", [(d.stream, d.entry_id) for d in held])
    assert [d.job_id for d in claimed] == [jobs[1].id]
    # Redis 7 drops a deleted entry from the pending list as it claims it; older ones hand it
    # back empty, and the claim acks it: either way it is pending no more.
    assert gone in ([], [(held[0].stream, held[0].entry_id)])
    assert _pending(redis_client, q) == {(held[1].stream, held[1].entry_id): "w2"}


def test_claim_orphans_takes_count_entries_across_buckets(redis_client: redis.Redis,
                                                          keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    specs = _spread(5, tag="d")
    for spec in specs:
        q.enqueue([spec])
    q.heartbeat("dead", 60_000)
    q.heartbeat("live", 60_000)
    held = q.read("dead", count=5)
    assert len(held) == 5
    # The claimer itself has no heartbeat (yet): its own entries are not orphans.
    q.enqueue([JobSpec(model="m", prompt="claimer's own")])
    (own,) = q.read("claimer", count=1)
    redis_client.delete(keys.heartbeat("dead"))
    claimed = q.claim_orphans("claimer", count=3, min_idle_ms=0)
    assert len(claimed) == 3
    assert set(redis_client.hkeys(keys.workers())) == {"live"}
    owners = _pending(redis_client, q)
    assert owners[own.stream, own.entry_id] == "claimer"
    assert sorted(owners.values()) == ["claimer"] * 4 + ["dead"] * 2
    second = q.claim_orphans("claimer", count=10, min_idle_ms=0)
    assert len(second) == 2
    assert {d.job_id for d in claimed + second} == {s.id for s in specs}
    assert q.claim_orphans("claimer", count=0, min_idle_ms=0) == []


def test_a_dead_worker_holding_one_entry_has_it_claimed(redis_client: redis.Redis,
                                                        keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    (spec,) = _one_bucket([0], "one")
    q.enqueue([spec])
    q.heartbeat("dead", 60_000)
    (held,) = q.read("dead", count=1)
    q.drop_heartbeat("dead")
    claimed = q.claim_orphans("live", count=5, min_idle_ms=0)
    assert [(d.entry_id, d.job_id) for d in claimed] == [(held.entry_id, spec.id)]


def test_dead_letters_keep_id_payload_and_reason_and_leave_the_stream(
        redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    jobs = _one_bucket([0, 0], "dl")
    q.enqueue(jobs)
    held = q.read("w", count=2)
    q.dead_letter(held, ["too big", "bad schema"])
    assert q.depth() == (0, 0) and q.length() == 0
    letters = [f for _, f in redis_client.xrange(keys.dead_letter("m"))]
    assert [(f["id"], json.loads(f["job"])["id"], f["reason"]) for f in letters] == [
        (jobs[0].id, jobs[0].id, "too big"), (jobs[1].id, jobs[1].id, "bad schema")]
    q.dead_letter([], [])


def test_done_and_cancel_markers(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.done_channel(), keys.cancel_channel())
    signal_cancel(redis_client, keys, "j-run")
    assert 0 < redis_client.ttl(keys.cancel("j-run")) <= CANCEL_MARKER_TTL_S
    assert q.cancel_requested(["j-queued", "j-run"]) == ["j-run"]
    assert q.cancel_requested([]) == []
    announce_ended(redis_client, keys, JobStatus.CANCELLED,
                   [("j-queued", JobStatus.QUEUED.value), ("j-run", JobStatus.RUNNING.value)])
    for job_id in ("j-queued", "j-run"):
        assert redis_client.get(keys.done(job_id)) == "cancelled"
        assert 0 < redis_client.ttl(keys.done(job_id)) <= DONE_MARKER_TTL_S
    # The running job is asked to abort (after its end cleared the earlier marker); the
    # queued one is not.
    assert q.cancel_requested(["j-queued", "j-run"]) == ["j-run"]
    q.publish_done([("j-run", "cancelled")])
    assert q.cancel_requested(["j-run"]) == []
    messages = []
    deadline = time.monotonic() + 30
    while len(messages) < 5 and time.monotonic() < deadline:
        m = pubsub.get_message(timeout=0.5)
        if m is not None:
            messages.append((m["channel"], m["data"]))
    pubsub.close()
    done, cancel = keys.done_channel(), keys.cancel_channel()
    assert messages == [
        (cancel, "j-run"),
        (done, json.dumps({"id": "j-queued", "status": "cancelled"})),
        (done, json.dumps({"id": "j-run", "status": "cancelled"})),
        (cancel, "j-run"),
        (done, json.dumps({"id": "j-run", "status": "cancelled"})),
    ]


@pytest.mark.timeout(120)
def test_drop_and_listing_page_through_long_streams(redis_client: redis.Redis,
                                                    keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    jobs = _one_bucket([0] * 7, "long")
    q.enqueue(jobs)
    assert q.job_ids_in_stream(chunk=1) == {s.id for s in jobs}
    assert q.job_ids_in_stream(chunk=3) == {s.id for s in jobs}
    doomed = {jobs[1].id, jobs[4].id, jobs[6].id}
    assert q.drop(doomed | {"not-there"}, chunk=2) == 3
    assert q.job_ids_in_stream(chunk=2) == {s.id for s in jobs} - doomed
    assert q.length() == 4


def test_claim_orphans_stops_at_count_within_a_bucket(redis_client: redis.Redis,
                                                      keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    a = [JobSpec(model="m", prompt=f"{'a' * PREFIX_KEY_CHARS}{i}") for i in range(2)]
    b = [JobSpec(model="m", prompt=f"{'b' * PREFIX_KEY_CHARS}{i}") for i in range(2)]
    q.enqueue(a + b)
    q.heartbeat("dead", 60_000)
    q.read("dead", count=4)
    q.drop_heartbeat("dead")
    first = q.claim_orphans("live", count=3, min_idle_ms=0)
    assert len(first) == 3
    assert sorted(_pending(redis_client, q).values()) == ["dead", "live", "live", "live"]
    assert len(q.claim_orphans("live", count=3, min_idle_ms=0)) == 1


def test_a_claim_skips_entries_not_idle_long_enough(redis_client: redis.Redis,
                                                    keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.enqueue(_one_bucket([0, 0], "idle"))
    held = q.read("w1", count=2)
    refs = [(d.stream, d.entry_id) for d in held]
    assert q.claim("w2", refs, min_idle_ms=3_600_000) == ([], [])
    assert set(_pending(redis_client, q).values()) == {"w1"}
    claimed, _ = q.claim("w2", refs, min_idle_ms=0)
    assert [d.entry_id for d in claimed] == [d.entry_id for d in held]


def test_an_entry_with_an_empty_job_id_has_none(redis_client: redis.Redis,
                                                keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    redis_client.xadd(q.streams[0], {"id": "", "job": "{}"})
    (d,) = q.read("w", 1)
    assert d.job_id is None and d.payload == "{}"
