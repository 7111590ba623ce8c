"""Aggregate statistics of finished jobs, over rows of the ``job_stats`` view.

The same figures on PostgreSQL and SQLite: rows are read with one query
(``JobReader.job_stats_rows``) and aggregated here (percentiles included), so no
dialect-specific SQL is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class Stats:
    """Aggregates over finished jobs (all terminal statuses; latencies of succeeded jobs).

    ``wall_s`` runs from the first submission to the last finish; throughputs divide by it.
    Latency percentiles are seconds from submission (see ``JobStats``).
    """

    jobs: int
    by_status: dict[str, int]
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    wall_s: float
    peak_kv_bytes: int
    preemptions: int
    gpu_s: float  # the jobs' cost in GPU-seconds (their shares of the engine steps they ran in)
    e2e_s: dict[str, float | None]  # p50 / p90 / p99
    ttft_s: dict[str, float | None]
    queue_wait_s: dict[str, float | None]

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt (computed or cached) plus generated tokens per second."""
        tokens = self.prompt_tokens + self.generated_tokens
        return tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def aggregate(rows: list[dict[str, Any]]) -> Stats:
    """:class:`Stats` of ``job_stats`` rows (as ``JobReader.job_stats_rows`` returns them)."""
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    ok = [r for r in rows if r["status"] == "succeeded"]
    wall_s = 0.0
    if rows:
        first = min(_utc(r["created_at"]) for r in rows)
        last = max(_utc(r["finished_at"]) for r in rows)
        wall_s = max((last - first).total_seconds(), 0.0)
    return Stats(
        jobs=len(rows),
        by_status=by_status,
        prompt_tokens=sum(r["prompt_tokens"] or 0 for r in rows),
        cached_prompt_tokens=sum(r["cached_prompt_tokens"] or 0 for r in rows),
        generated_tokens=sum(r["generated_tokens"] or 0 for r in rows),
        wall_s=wall_s,
        peak_kv_bytes=max((r["peak_kv_bytes"] or 0 for r in rows), default=0),
        preemptions=sum(r["preemptions"] or 0 for r in rows),
        gpu_s=sum(r.get("gpu_s") or 0.0 for r in rows),
        e2e_s=percentiles([r["e2e_s"] for r in ok]),
        ttft_s=percentiles([r["ttft_s"] for r in ok]),
        queue_wait_s=percentiles([r["queue_wait_s"] for r in ok]),
    )


def percentiles(values: list[float | None], qs: tuple[int, ...] = (50, 90, 99),
                ) -> dict[str, float | None]:
    """Linear-interpolated percentiles (``{"p50": …}``) of the non-null ``values``."""
    data = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {}
    for q in qs:
        if not data:
            out[f"p{q}"] = None
            continue
        pos = (len(data) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(data) - 1)
        out[f"p{q}"] = data[lo] + (data[hi] - data[lo]) * (pos - lo)
    return out


def _utc(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)
