"""The delay before a webhook's next attempt: the first delay, doubling, capped at an hour."""

from __future__ import annotations

import pytest

from worker.control.webhook import MAX_BACKOFF_S, backoff_s


@pytest.mark.parametrize(("attempts", "first_s", "delay_s"), [
    (0, 5.0, 5.0),  # before any attempt failed
    (1, 5.0, 5.0),
    (2, 5.0, 10.0),
    (3, 5.0, 20.0),
    (4, 7.5, 60.0),
    (10, 5.0, 2560.0),
    (11, 5.0, MAX_BACKOFF_S),  # 5120 s capped
    (60, 5.0, MAX_BACKOFF_S),
])
def test_backoff_doubles_from_the_first_delay_up_to_an_hour(
        attempts: int, first_s: float, delay_s: float) -> None:
    assert backoff_s(attempts, first_s) == delay_s
    assert MAX_BACKOFF_S == 3600.0
