"""The worker's heartbeat thread (``worker.heartbeat``) against the real Redis, value by value:
the first beat at start (its TTL in milliseconds, the window and the adapters it announces),
its pacing constants, renewal only while the loop reports progress and again once it does, a
stall logged once per stall, a failed beat that does not end the thread, and a stop that joins
it. Conditions are waited for with generous ceilings, never timed."""

from __future__ import annotations

import logging
import threading

import pytest
import redis
from services import wait_until

from jobs.constants import Keys
from jobs.queue import JobQueue, live_adapters

MODEL = "tiny"


class _CountingQueue(JobQueue):
    """The real queue, counting its heartbeats; ``fail`` makes the next ones raise."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.beats = 0
        self.fail = 0
        self.lock = threading.Lock()

    def heartbeat(self, *args: object, **kwargs: object) -> None:
        with self.lock:
            self.beats += 1
            if self.fail:
                self.fail -= 1
                raise redis.ConnectionError("failover")
        super().heartbeat(*args, **kwargs)  # type: ignore[arg-type]


def _heartbeat(q: JobQueue, **kw: object):  # type: ignore[no-untyped-def]
    from worker.heartbeat import Heartbeat

    return Heartbeat(q, kw.pop("worker_id", "w1"), **kw)  # type: ignore[arg-type]


def test_start_beats_once_at_once_with_its_ttl_window_and_adapters(
        redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, MODEL, keys)
    beat = _heartbeat(q, lease_ttl_s=6.0, stall_s=60.0, window=7,
                      adapters=("tiny:a", "tiny:b"))
    assert (beat.lease_ttl_ms, beat.interval_s, beat.stall_s) == (6000, 2.0, 60.0)
    beat.start()
    try:
        assert q.live_workers() == {"w1"}  # no wait for the first interval
        assert 5000 < redis_client.pttl(keys.heartbeat("w1")) <= 6000
        assert q.serving() == {"w1": 7}
        assert live_adapters(redis_client, keys) == {"tiny:a", "tiny:b"}
    finally:
        beat.stop()
    assert not beat._thread.is_alive()  # stop joined it


def test_renews_while_the_loop_progresses_lapses_when_it_stalls_and_resumes(
        redis_client: redis.Redis, keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    q = _CountingQueue(redis_client, MODEL, keys)
    beat = _heartbeat(q, lease_ttl_s=0.6, stall_s=1.5, window=3, adapters=("tiny:a",))
    caplog.set_level(logging.ERROR, logger="worker.heartbeat")

    def progressing(n: int) -> bool:
        beat.progress()
        return q.beats >= n

    beat.start()
    try:
        wait_until(lambda: progressing(4), 30, 0.05, what="three beats while progressing")
        # the window and adapters are announced again with each beat
        redis_client.hdel(keys.feed_windows(MODEL), "w1")
        redis_client.hdel(keys.adapters(), "w1")
        n = q.beats
        wait_until(lambda: progressing(n + 2), 30, 0.05, what="more beats")
        assert q.serving() == {"w1": 3} and live_adapters(redis_client, keys) == {"tiny:a"}
        # no progress: the beats stop and the lease runs out
        wait_until(lambda: not q.live_workers(), 30, 0.05, what="the lease lapsed")
        stalls = [r for r in caplog.records if "made no progress" in r.getMessage()]
        assert len(stalls) == 1
        # progress again: renewed again
        wait_until(lambda: progressing(1) and q.live_workers() == {"w1"}, 30, 0.05,
                   what="renewed after progress")
        wait_until(lambda: not q.live_workers(), 30, 0.05, what="lapsed again")
        stalls = [r for r in caplog.records if "made no progress" in r.getMessage()]
        assert len(stalls) == 2  # each stall is logged once
    finally:
        beat.stop()


def test_a_failed_beat_does_not_end_the_thread(redis_client: redis.Redis, keys: Keys) -> None:
    q = _CountingQueue(redis_client, MODEL, keys)
    beat = _heartbeat(q, lease_ttl_s=0.6, stall_s=60.0, window=1)
    beat.start()
    try:
        with q.lock:
            q.fail = 2
        n = q.beats
        wait_until(lambda: q.beats >= n + 4 and q.live_workers() == {"w1"}, 30, 0.05,
                   what="beats after two failures")
        assert beat._thread.is_alive()
    finally:
        beat.stop()
    assert not beat._thread.is_alive()
