"""``jobs.follow`` value by value, with no model and no worker: jobs stored by a ``JobClient``,
their outcomes stored by hand, a ``Follower`` and a ``NoticeHub`` driven by hand. Checked: what
each ``take`` reports and in which order, when a follower reads SQL by itself, the batch
follower's count shortcut, the hub's poll of joined followers, notices of the done channel,
and the bookkeeping of followers leaving the hub."""

from __future__ import annotations

import json
import time

import redis
import sqlalchemy as sa

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.follow import SAFETY_WAKE_S, Follower, NoticeHub, done_job_id
from jobs.schemas import JobResult, JobSpec, JobStatus, Outcome
from jobs.store import DeliveryStore, JobReader

MODEL = "tiny"


def _jobs(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, n: int,
          batch_id: str | None = None) -> list[str]:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    specs = [JobSpec(model=MODEL, prompt=f"p{i}", batch_id=batch_id,
                     custom_id=f"c{i}" if batch_id else None) for i in range(n)]
    client.submit(specs)
    return [s.id for s in specs]


def _settle(pg_engine: sa.Engine, finished: dict[str, float]) -> None:
    store = DeliveryStore(pg_engine)
    store.begin_deliveries(list(finished), "w", 3, time.time())
    store.finish([Outcome(j, JobStatus.SUCCEEDED, at, result=JobResult(text=j))
                  for j, at in finished.items()])


def test_a_batch_follower_polls_by_itself_and_reports_in_finish_order(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    ids = _jobs(redis_client, keys, pg_engine, 5, batch_id="fb")
    reader = JobReader(pg_engine)
    follower = Follower(reader, ids, timeout_s=None, poll_interval_s=3600, batch_id="fb")
    assert not follower.shared_poll and follower.pending == set(ids)
    assert follower.take() == []  # the first take reads SQL: nothing is terminal
    now = time.time()
    _settle(pg_engine, {ids[3]: now - 1, ids[1]: now - 3, ids[4]: now - 2})
    assert follower.take() == []  # the next poll is an hour away, and no notice came
    assert 3500 < follower.wait_s() <= 3600
    follower.poll_interval_s = 0.0
    follower._next_poll = 0.0
    infos = follower.take()
    assert [i.id for i in infos] == [ids[1], ids[4], ids[3]]  # oldest finish first
    assert all(i.result.text == i.id for i in infos)
    assert follower.pending == {ids[0], ids[2]} and follower.reported == 3
    assert follower.take() == []  # nothing new: reported once
    _settle(pg_engine, {ids[0]: now, ids[2]: now + 1})
    assert [i.id for i in follower.take()] == [ids[0], ids[2]]
    assert follower.pending == set() and follower.reported == 5


def test_the_batch_count_shortcut(redis_client: redis.Redis, keys: Keys,
                                  pg_engine: sa.Engine) -> None:
    """A batch follower reads ids only when the batch's terminal count exceeds what it
    reported; it reads them when it does."""
    ids = _jobs(redis_client, keys, pg_engine, 4, batch_id="fc")
    reader = JobReader(pg_engine)
    reads: list[list[str]] = []
    terminal_ids = reader.terminal_ids

    def counted(job_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(list(job_ids))
        return terminal_ids(job_ids, *args, **kwargs)

    reader.terminal_ids = counted  # type: ignore[method-assign]
    follower = Follower(reader, ids, timeout_s=None, poll_interval_s=0.0, batch_id="fc")
    assert follower.take_ids() == set() and reads == []  # no job terminal: no id read
    _settle(pg_engine, {ids[2]: time.time()})
    assert follower.take_ids() == {ids[2]} and reads == [sorted(ids)]
    assert follower.take_ids() == set() and len(reads) == 1  # count 1, reported 1
    _settle(pg_engine, {ids[0]: time.time(), ids[1]: time.time()})
    assert follower.take_ids() == {ids[0], ids[1]}
    assert reads[-1] == sorted([ids[0], ids[1], ids[3]])  # the pending ones only


def test_a_shared_follower_reads_only_what_it_was_told(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    ids = _jobs(redis_client, keys, pg_engine, 3)
    reader = JobReader(pg_engine)
    follower = Follower(reader, ids, timeout_s=None)
    assert follower.shared_poll
    _settle(pg_engine, {ids[0]: time.time(), ids[1]: time.time() - 5})
    assert follower.take() == []  # its hub polls for it
    assert SAFETY_WAKE_S - 1 < follower.wait_s() <= SAFETY_WAKE_S
    follower.notice_id(ids[2])  # announced but not terminal (yet): not reported
    follower.notice_id("someone-else")
    follower.notice_id(ids[0])
    follower.notice_id(ids[1])
    assert [i.id for i in follower.take()] == [ids[1], ids[0]]
    assert follower.pending == {ids[2]} and follower.reported == 2
    follower.notice_id(ids[0])  # a second notice of a reported job
    assert follower.take() == [] and follower.reported == 2
    _settle(pg_engine, {ids[2]: time.time()})
    follower.add(["extra"])
    assert follower.pending == {ids[2], "extra"}
    follower.notice_id(ids[2])
    assert follower.take_ids() == {ids[2]} and follower.pending == {"extra"}
    # A deadline bounds the wait, and passes.
    timed = Follower(reader, ids, timeout_s=0.0)
    assert timed.wait_s() == 0.0 and timed.expired()
    assert not Follower(reader, ids, timeout_s=3600).expired()
    assert not follower.expired()


def test_the_hub_polls_joined_followers_and_forgets_those_that_leave(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    ids = _jobs(redis_client, keys, pg_engine, 4)
    reader = JobReader(pg_engine)
    hub = NoticeHub(redis_client, keys.prefix + "no-such-channel", reader)
    hub.close()  # driven by hand: no thread
    a = Follower(reader, ids[:2], timeout_s=None, poll_interval_s=7.0)
    b = Follower(reader, ids[1:], timeout_s=None, poll_interval_s=3.0)
    batch = Follower(reader, ids[:1], timeout_s=None, poll_interval_s=60.0,
                     batch_id="x")  # polls by itself
    woken: list[str] = []
    for name, f in (("a", a), ("b", b), ("batch", batch)):
        hub._wake_of[id(f)] = lambda name=name: woken.append(name)  # type: ignore[misc]
        hub._register(f, list(f.pending))
    assert len(hub) == 3
    _settle(pg_engine, {ids[1]: time.time(), ids[3]: time.time()})
    # The jobs of the followers that joined, read once: ids[1] wakes a and b, ids[3] wakes b.
    assert hub._poll(everyone=False) == 3.0  # the shortest interval asked for
    assert sorted(woken) == ["a", "b", "b"]
    assert a._noticed == {ids[1]} and b._noticed == {ids[1], ids[3]}
    assert batch._noticed == set()
    woken.clear()
    assert hub._poll(everyone=False) == 3.0 and woken == []  # nobody joined since
    assert hub._poll(everyone=True) == 3.0 and sorted(woken) == ["a", "b", "b"]
    hub.remove(b)
    assert len(hub) == 2 and set(hub._by_job) == {ids[0], ids[1]}
    hub.remove(batch)
    assert len(hub) == 1 and set(hub._by_job) == {ids[0], ids[1]}
    assert hub._poll(everyone=True) == 7.0
    hub.remove(a)
    assert len(hub) == 0 and hub._by_job == {} and hub._poll(everyone=True) == 1.0
    # A batch follower joining alone: its jobs are not read by the hub.
    woken.clear()
    hub._wake_of[id(batch)] = lambda: woken.append("batch")
    hub._register(batch, [ids[3]])
    assert hub._joined == [] and hub._poll(everyone=False) == 1.0 and woken == []
    # Two more followers of that job (terminal): the hub reads it though a batch follower
    # follows it too, as often as the more eager one asks.
    fast = Follower(reader, ids[3:], timeout_s=None, poll_interval_s=2.0)
    slow = Follower(reader, ids[3:], timeout_s=None, poll_interval_s=5.0)
    for f in (fast, slow):
        hub._wake_of[id(f)] = lambda: None
        hub._register(f, list(f.pending))
    assert hub._poll(everyone=True) == 2.0
    assert fast._noticed == slow._noticed == {ids[3]}


def test_notices_of_the_done_channel(redis_client: redis.Redis, keys: Keys,
                                     pg_engine: sa.Engine) -> None:
    assert done_job_id({"type": "message", "data": json.dumps({"id": "j1",
                                                                "status": "succeeded"})}) == "j1"
    assert done_job_id({"type": "message", "data": b'{"id": "j2"}'}) == "j2"
    for message in (None, {}, {"type": "subscribe", "data": 1},
                    {"type": "pmessage", "data": json.dumps({"id": "j3"})},
                    {"type": "message", "data": "not json"},
                    {"type": "message", "data": "[1]"},
                    {"type": "message", "data": json.dumps({"id": 7})},
                    {"type": "message", "data": json.dumps({"job": "j"})}):
        assert done_job_id(message) is None  # type: ignore[arg-type]
    # Through the hub's own thread: a published notice wakes the follower of that job only.
    ids = _jobs(redis_client, keys, pg_engine, 2)
    reader = JobReader(pg_engine)
    channel = keys.prefix + "done-test"
    hub = NoticeHub(redis_client, channel, reader)
    follower = Follower(reader, ids, timeout_s=None, poll_interval_s=3600)
    woken: list[int] = []
    hub.add(follower, lambda: woken.append(1))
    try:
        deadline = time.monotonic() + 30
        while redis_client.pubsub_numsub(channel)[0][1] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        redis_client.publish(channel, json.dumps({"id": ids[1], "status": "succeeded"}))
        redis_client.publish(channel, json.dumps({"id": "unrelated"}))
        while not follower._noticed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert follower._noticed == {ids[1]} and woken == [1]
    finally:
        hub.remove(follower)
        hub.close()
