"""The worker's retry pacing and error text (``worker.retry``) value by value, with explicit
``now`` values: the backoff's first delay, its doubling and its cap, ``ok`` resetting it, the
shared Redis backoff skipping steps while it waits and ending on a success, which database
errors are outages, and how an exception's text is shortened."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError

from worker.retry import (
    BACKOFF_BASE_S,
    MAX_BACKOFF_S,
    Backoff,
    RedisBackoff,
    is_outage,
    short_error,
)


def test_the_constants() -> None:
    assert (BACKOFF_BASE_S, MAX_BACKOFF_S) == (0.1, 10.0)


def test_backoff_starts_at_0_2_s_doubles_and_is_capped_at_10_s() -> None:
    b = Backoff()
    assert b.ready(0.0)  # never failed: ready
    delays = []
    for i in range(10):
        now = 1000.0 + i
        b.failed(now)
        delays.append(round(b.retry_at - now, 6))
    assert delays == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0, 10.0]
    assert b.failures == 10


def test_ready_at_exactly_the_retry_time() -> None:
    b = Backoff()
    b.failed(100.0)
    assert b.retry_at == pytest.approx(100.2)
    assert not b.ready(100.0) and not b.ready(b.retry_at - 1e-6)
    assert b.ready(b.retry_at) and b.ready(b.retry_at + 5)


def test_ok_resets_both_the_count_and_the_wait() -> None:
    b = Backoff()
    for _ in range(5):
        b.failed(50.0)
    b.ok()
    assert (b.failures, b.retry_at) == (0, 0.0)
    assert b.ready(0.0)
    b.failed(60.0)  # the next failure starts over at the first delay
    assert b.retry_at == pytest.approx(60.2)


@pytest.mark.parametrize("error", [redis.ConnectionError("down"), redis.TimeoutError("slow"),
                                   redis.ResponseError("LOADING"), redis.BusyLoadingError("x")])
def test_redis_backoff_waits_after_any_redis_error_and_skips_steps(
        error: redis.RedisError) -> None:
    calls: list[float] = []

    def failing(now: float):  # type: ignore[no-untyped-def]
        def step() -> None:
            calls.append(now)
            raise error
        return step

    shared = RedisBackoff()
    shared.call(10.0, failing(10.0))  # fails: waits 0.2 s
    assert calls == [10.0] and not shared.ready(10.1) and shared.ready(10.2)
    shared.call(10.1, failing(10.1))  # skipped: still waiting
    assert calls == [10.0]
    shared.call(10.2, failing(10.2))  # runs, fails again: waits 0.4 s
    assert calls == [10.0, 10.2]
    assert not shared.ready(10.59) and shared.ready(10.6)
    ran: list[int] = []
    shared.call(10.6, lambda: ran.append(1))  # a success ends the backoff
    assert ran == [1] and shared.ready(0.0)
    shared.call(20.0, failing(20.0))  # and the next failure starts over at 0.2 s
    assert not shared.ready(20.19) and shared.ready(20.2)
    shared.reset()
    assert shared.ready(0.0)


def test_redis_backoff_lets_other_errors_through() -> None:
    shared = RedisBackoff()

    def broken() -> None:
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        shared.call(1.0, broken)
    assert shared.ready(1.0)


def test_only_refusals_of_the_data_are_not_outages() -> None:
    assert not is_outage(DataError("INSERT", {}, Exception("value too long")))
    assert not is_outage(IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert is_outage(OperationalError("SELECT", {}, Exception("connection refused")))
    assert is_outage(ProgrammingError("SELECT", {}, Exception("relation does not exist")))


def test_short_error_keeps_three_lines_and_500_characters() -> None:
    assert short_error(ValueError("  one\ntwo\nthree\nfour  ")) == "one two three"
    assert short_error(ValueError("\n\nfirst\nsecond")) == "first second"
    assert short_error(KeyError()) == "KeyError"
    assert short_error(RuntimeError("")) == "RuntimeError"
    assert short_error(ValueError("x" * 500)) == "x" * 500
    assert short_error(ValueError("x" * 501)) == "x" * 497 + "..."
    assert short_error(ValueError("abcdefghij"), limit=9) == "abcdef..."
    assert len(short_error(ValueError("y" * 10_000))) == 500
