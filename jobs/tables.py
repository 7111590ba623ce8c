"""Plain-text tables and human units for the command line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jobs.schemas import JobStats, is_bytes

if TYPE_CHECKING:
    from jobs.stats import Stats


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) or row[i] is None for row in rows) and rows
               for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return printable(str(value))


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``): what a job or a model
    name carries never reaches the terminal as an escape sequence."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_stats(stats: Stats) -> str:
    """Aggregate statistics as a two-column table."""
    def pct(p: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in p.values())

    status = ", ".join(f"{n} {s}" for s, n in sorted(stats.by_status.items())) or "none"
    rows = [
        ("jobs", f"{stats.jobs} ({status})"),
        ("prompt tokens", f"{stats.prompt_tokens} ({stats.cached_prompt_tokens} from the "
                          f"prefix cache, hit rate {stats.prefix_cache_hit_rate:.0%})"),
        ("generated tokens", str(stats.generated_tokens)),
        ("wall time", f"{stats.wall_s:.1f} s (first submission to last finish)"),
        ("throughput", f"{stats.output_tokens_per_s:.1f} output tok/s, "
                       f"{stats.total_tokens_per_s:.1f} total tok/s"),
        ("e2e latency p50/p90/p99", pct(stats.e2e_s) + " s"),
        ("ttft p50/p90/p99", pct(stats.ttft_s) + " s"),
        ("queue wait p50/p90/p99", pct(stats.queue_wait_s) + " s"),
        ("peak KV memory (one job)", human_bytes(stats.peak_kv_bytes)),
        ("preemptions", str(stats.preemptions)),
        ("cost", f"{stats.gpu_s:.3f} GPU-seconds"),
    ]
    return format_table(("metric", "value"), rows)


# (row key, heading): the job, then every JobStats field under its title.
JOB_COLUMNS = (("custom_id", "custom_id"), ("status", "status"),
               *((name, field.title or name) for name, field in JobStats.model_fields.items()))


def format_job_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Per-job rows of the ``job_stats`` view (see ``JobReader.job_stats_rows``)."""
    cells = [[human_bytes(r[k]) if k in JobStats.model_fields and is_bytes(k) else r[k]
              for k, _ in JOB_COLUMNS] for r in rows]
    return format_table([h for _, h in JOB_COLUMNS], cells)
