"""``jobs.stats.aggregate`` and ``percentiles`` on rows whose every figure is known: the sums,
the peak, the counts by status, latencies of succeeded jobs only, the wall time and the rates."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from jobs.stats import Stats, aggregate, percentiles

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def _row(status: str = "succeeded", *, start_s: float = 0.0, end_s: float = 1.0,
         **figures: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "status": status, "created_at": T0 + timedelta(seconds=start_s),
        "finished_at": T0 + timedelta(seconds=end_s), "prompt_tokens": None,
        "cached_prompt_tokens": None, "generated_tokens": None, "peak_kv_bytes": None,
        "preemptions": None, "gpu_s": None, "e2e_s": None, "ttft_s": None,
        "queue_wait_s": None}
    row.update(figures)
    return row


def test_sums_peak_and_counts_by_status() -> None:
    rows = [
        _row(start_s=0, end_s=4, prompt_tokens=10, cached_prompt_tokens=4, generated_tokens=3,
             peak_kv_bytes=100, preemptions=2, gpu_s=0.25, e2e_s=4.0, ttft_s=1.0,
             queue_wait_s=0.5),
        _row("failed", start_s=1, end_s=2, prompt_tokens=6, cached_prompt_tokens=2,
             generated_tokens=1, peak_kv_bytes=300, preemptions=1, gpu_s=0.5, e2e_s=99.0,
             ttft_s=99.0, queue_wait_s=99.0),
        _row("cancelled", start_s=2, end_s=3, prompt_tokens=None, generated_tokens=None),
        _row(start_s=3, end_s=8, prompt_tokens=4, cached_prompt_tokens=0, generated_tokens=7,
             peak_kv_bytes=200, preemptions=3, gpu_s=2.0, e2e_s=5.0, ttft_s=2.0,
             queue_wait_s=1.5),
    ]
    s = aggregate(rows)
    assert replace(s, e2e_s={}, ttft_s={}, queue_wait_s={}) == Stats(
        jobs=4, by_status={"succeeded": 2, "failed": 1, "cancelled": 1}, prompt_tokens=20,
        cached_prompt_tokens=6, generated_tokens=11, wall_s=8.0, peak_kv_bytes=300,
        preemptions=6, gpu_s=2.75, e2e_s={}, ttft_s={}, queue_wait_s={})
    # latencies of the succeeded jobs only: the failed job's 99s are left out
    assert s.e2e_s == pytest.approx({"p50": 4.5, "p90": 4.9, "p99": 4.99})
    assert s.ttft_s == pytest.approx({"p50": 1.5, "p90": 1.9, "p99": 1.99})
    assert s.queue_wait_s == pytest.approx({"p50": 1.0, "p90": 1.4, "p99": 1.49})
    assert s.output_tokens_per_s == 11 / 8
    assert s.total_tokens_per_s == (20 + 11) / 8
    assert s.prefix_cache_hit_rate == 6 / 20


def test_no_rows() -> None:
    s = aggregate([])
    assert (s.jobs, s.by_status, s.wall_s, s.peak_kv_bytes, s.preemptions, s.gpu_s) == (
        0, {}, 0.0, 0, 0, 0.0)
    assert (s.prompt_tokens, s.cached_prompt_tokens, s.generated_tokens) == (0, 0, 0)
    assert s.e2e_s == {"p50": None, "p90": None, "p99": None}
    assert (s.output_tokens_per_s, s.total_tokens_per_s, s.prefix_cache_hit_rate) == (0, 0, 0)


def test_rows_whose_figures_are_all_null_count_as_zero() -> None:
    s = aggregate([_row("expired"), _row("expired")])
    assert (s.jobs, s.by_status) == (2, {"expired": 2})
    assert (s.prompt_tokens, s.generated_tokens, s.peak_kv_bytes, s.preemptions) == (0, 0, 0, 0)
    assert s.ttft_s == {"p50": None, "p90": None, "p99": None}


def test_wall_time_runs_from_the_first_submission_to_the_last_finish() -> None:
    # the last submitted job is not the last to finish, the first to finish not the first in
    rows = [_row(start_s=2, end_s=30), _row(start_s=0, end_s=5), _row(start_s=10, end_s=12)]
    assert aggregate(rows).wall_s == 30.0


def test_naive_timestamps_are_utc() -> None:
    # SQLite gives naive datetimes: they are UTC, and mix with aware ones (here UTC+2)
    plus2 = timezone(timedelta(hours=2))
    rows = [_row(created_at=datetime(2026, 1, 1, 12, 0, 0), finished_at=datetime(
        2026, 1, 1, 14, 0, 10, tzinfo=plus2))]
    assert aggregate(rows).wall_s == 10.0


def test_a_finish_before_the_submission_is_no_negative_wall_time() -> None:
    s = aggregate([_row(start_s=5, end_s=1, generated_tokens=4)])
    assert s.wall_s == 0.0
    assert (s.output_tokens_per_s, s.total_tokens_per_s) == (0.0, 0.0)


def test_rates_of_a_positive_wall_time() -> None:
    s = aggregate([_row(start_s=0, end_s=2, prompt_tokens=0, generated_tokens=4)])
    assert (s.output_tokens_per_s, s.total_tokens_per_s, s.prefix_cache_hit_rate) == (
        2.0, 2.0, 0.0)


@pytest.mark.parametrize(("values", "expected"), [
    ([7.0], {"p50": 7.0, "p90": 7.0, "p99": 7.0}),
    ([2.0, 1.0], {"p50": 1.5, "p90": pytest.approx(1.9), "p99": pytest.approx(1.99)}),
    ([None, None], {"p50": None, "p90": None, "p99": None}),
    ([10.0, 0.0, 20.0, None], {"p50": 10.0, "p90": pytest.approx(18.0),
                               "p99": pytest.approx(19.8)}),
])
def test_percentiles_interpolate_between_the_sorted_values(values, expected) -> None:  # type: ignore[no-untyped-def]
    assert percentiles(values) == expected


def test_percentiles_of_chosen_quantiles() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0], qs=(0, 25, 100)) == {
        "p0": 1.0, "p25": 2.0, "p100": 5.0}
    assert percentiles([3.0], qs=(100,)) == {"p100": 3.0}
