"""Writes the Grafana dashboards in ``deploy/grafana/dashboards/`` (run it after editing here;
tests/deploy checks that the committed JSON is what this produces, and that every query names
a metric the worker exports or runs against the real ``job_stats`` view).

    python deploy/grafana/make_dashboards.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
PROM = {"type": "prometheus", "uid": "kvbatch-prometheus"}
PG = {"type": "grafana-postgresql-datasource", "uid": "kvbatch-postgres"}
SEL = '{model_name=~"$model"}'
FINISHED_BY_WORKERS = ("Jobs a worker finished (the workers' kvbatch_jobs_total). Jobs the "
                       "control plane expired or reaped, and queued jobs cancelled before "
                       "delivery, are not in it: see the PostgreSQL panel next to it.")
RATE = "[$__rate_interval]"


class Grid:
    """Lays panels out left to right on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos


def prom_panel(grid: Grid, pid: int, title: str, targets: list[tuple[str, str]], unit: str,
               kind: str = "timeseries", w: int = 8, h: int = 8,
               description: str = "") -> dict[str, Any]:
    return {
        "id": pid, "type": kind, "title": title, "description": description,
        "datasource": PROM, "gridPos": grid.place(w, h),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        # Stat and bar-gauge panels show one value per series: an instant query, not a range.
        "targets": [{"refId": chr(ord("A") + i), "datasource": PROM, "expr": expr,
                     "legendFormat": legend, "instant": kind != "timeseries",
                     "range": kind == "timeseries"}
                    for i, (expr, legend) in enumerate(targets)],
    }


def quantiles(metric: str, label: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate(kvbatch_{metric}_bucket{SEL}{RATE})))",
             f"{label} p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def overview() -> dict[str, Any]:
    g = Grid()
    panels = [
        prom_panel(g, 1, "Jobs running / waiting", [
            (f"sum(kvbatch_num_requests_running{SEL})", "running"),
            (f"sum(kvbatch_num_requests_waiting{SEL})", "waiting (in the engines)"),
            (f"sum(kvbatch_num_requests_swapped{SEL})", "swapped"),
        ], "short", description="Requests inside the workers' engines."),
        prom_panel(g, 2, "Queue depth", [
            (f"max by (model_name) (kvbatch_queue_depth{SEL})", "{{model_name}} waiting in Redis"),
            (f"max by (model_name) (kvbatch_queue_backlog{SEL})",
             "{{model_name}} waiting in SQL (backlog)"),
            (f"sum by (model_name) (kvbatch_jobs_in_flight{SEL})",
             "{{model_name}} held by workers"),
        ], "short", description="Every worker reports its model's stream depth: max, not sum."),
        prom_panel(g, 3, "Workers reporting", [
            (f"count by (model_name) (kvbatch_jobs_in_flight{SEL})", "{{model_name}}"),
        ], "short", kind="stat"),
        prom_panel(g, 4, "Throughput", [
            (f"sum(rate(kvbatch_prompt_tokens_total{SEL}{RATE}))", "prompt tokens/s"),
            (f"sum(rate(kvbatch_prompt_tokens_cached_total{SEL}{RATE}))",
             "prompt tokens/s from the prefix cache"),
            (f"sum(rate(kvbatch_generation_tokens_total{SEL}{RATE}))", "generated tokens/s"),
        ], "short", w=12, description="Prompt tokens of every request scheduled (as vLLM "
                                      "counts them), those of them served from the prefix "
                                      "cache, and generated tokens."),
        prom_panel(g, 5, "Jobs finished by workers, by status", [
            (f"sum by (status) (rate(kvbatch_jobs_total{SEL}{RATE}))", "{{status}}"),
        ], "ops", w=12, description=FINISHED_BY_WORKERS),
        prom_panel(g, 6, "Time to first token", quantiles("time_to_first_token_seconds", "TTFT"),
                   "s", description="From submission, so it includes the queue wait."),
        prom_panel(g, 7, "Inter-token latency",
                   quantiles("inter_token_latency_seconds", "ITL"), "s"),
        prom_panel(g, 8, "End-to-end latency",
                   quantiles("e2e_request_latency_seconds", "e2e")
                   + quantiles("request_queue_time_seconds", "queue")[::2], "s"),
        prom_panel(g, 9, "KV-cache usage", [
            (f"max by (instance) (kvbatch_kv_cache_usage_perc{SEL})", "{{instance}}"),
        ], "percentunit", description="Share of each worker's KV blocks in use."),
        prom_panel(g, 10, "Prefix-cache hit rate", [
            (f"sum(rate(kvbatch_prefix_cache_hits_total{SEL}{RATE})) / "
             f"sum(rate(kvbatch_prefix_cache_queries_total{SEL}{RATE}))", "hit rate"),
        ], "percentunit", description="Prompt tokens found in the cache over prompt tokens "
                                      "looked up."),
        prom_panel(g, 11, "Preemptions", [
            (f"sum by (instance) (rate(kvbatch_num_preemptions_total{SEL}{RATE}))",
             "{{instance}}"),
        ], "ops", description="Sustained preemptions: the KV budget is too small for "
                              "max_num_seqs."),
        prom_panel(g, 12, "Jobs finished by workers (time range)", [
            (f"sum by (status) (increase(kvbatch_jobs_total{SEL}[$__range]))", "{{status}}"),
        ], "short", kind="bargauge", w=12, h=7, description=FINISHED_BY_WORKERS),
        sql_panel(g, 13, "Jobs by terminal status (time range, all models)", """
            SELECT status, count(*) AS jobs
            FROM job_stats WHERE $__timeFilter(finished_at)
            GROUP BY status ORDER BY status""", "bargauge", w=12, h=7,
                  description="Every job that reached a terminal status, from PostgreSQL: "
                              "also those the control plane expired or reaped and queued jobs "
                              "cancelled before any worker saw them."),
    ]
    variables = [{
        "name": "model", "label": "model", "type": "query", "datasource": PROM,
        "query": {"query": "label_values(kvbatch_jobs_in_flight, model_name)",
                  "refId": "model"},
        "definition": "label_values(kvbatch_jobs_in_flight, model_name)",
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
        "current": {"text": "All", "value": "$__all"},
    }]
    return dashboard("kvbatch-overview", "kvbatch / Overview", panels, variables, "30s",
                     "now-1h")


def sql_panel(grid: Grid, pid: int, title: str, sql: str, kind: str, unit: str = "short",
              w: int = 12, h: int = 9, description: str = "") -> dict[str, Any]:
    fmt = "time_series" if kind == "timeseries" else "table"
    # A bar gauge over a table: one bar per row, named by its text column.
    options = ({"reduceOptions": {"values": True, "calcs": [], "fields": ""},
                "orientation": "horizontal", "displayMode": "gradient"}
               if kind == "bargauge" else {})
    return {
        "id": pid, "type": kind, "title": title, "description": description,
        "datasource": PG, "gridPos": grid.place(w, h),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options,
        "targets": [{"refId": "A", "datasource": PG, "format": fmt, "rawQuery": True,
                     "editorMode": "code", "rawSql": " ".join(sql.split())}],
    }


# The Jobs dashboard's `model` variable: with "All" selected, Grafana inserts the custom all
# value unquoted, and the filter lets every row through (even when no model is known yet, where
# the list of all values would be empty and `IN ()` a syntax error).
ALL_MODELS = "'__all'"


def model_filter(column: str = "model") -> str:
    return f"({ALL_MODELS} IN ($model) OR {column} IN ($model))"


MODELS_SQL = "SELECT DISTINCT model FROM jobs ORDER BY 1"


def jobs() -> dict[str, Any]:
    g = Grid()
    panels = [
        sql_panel(g, 1, "Batch progress", f"""
            SELECT b.id AS batch, b.model, b.status, b.num_jobs,
                   count(s.job_id) AS finished,
                   count(*) FILTER (WHERE s.status = 'succeeded') AS succeeded,
                   count(*) FILTER (WHERE s.status = 'failed') AS failed,
                   count(*) FILTER (WHERE s.status IN ('cancelled', 'expired'))
                       AS cancelled_or_expired,
                   round(100.0 * count(s.job_id) / NULLIF(b.num_jobs, 0), 1) AS pct_done,
                   b.created_at, b.completed_at
            FROM batches b LEFT JOIN job_stats s ON s.batch_id = b.id
            WHERE $__timeFilter(b.created_at) AND {model_filter('b.model')}
            GROUP BY b.id ORDER BY b.created_at DESC LIMIT 100""", "table", w=24,
                  description="Jobs of each batch that reached a terminal status."),
        sql_panel(g, 2, "Latency percentiles", f"""
            SELECT $__timeGroupAlias(finished_at, $__interval),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_s) AS "TTFT p50",
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY ttft_s) AS "TTFT p99",
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY e2e_s) AS "e2e p50",
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY e2e_s) AS "e2e p99",
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY tpot_s) AS "TPOT p50"
            FROM job_stats
            WHERE $__timeFilter(finished_at) AND status = 'succeeded' AND {model_filter()}
            GROUP BY 1 ORDER BY 1""", "timeseries", unit="s"),
        sql_panel(g, 3, "Cached-token share", f"""
            SELECT $__timeGroupAlias(finished_at, $__interval),
                   sum(cached_prompt_tokens)::float / NULLIF(sum(prompt_tokens), 0)
                       AS "cached share of prompt tokens"
            FROM job_stats WHERE $__timeFilter(finished_at) AND {model_filter()}
            GROUP BY 1 ORDER BY 1""", "timeseries", unit="percentunit"),
        sql_panel(g, 4, "Peak KV bytes per job", f"""
            SELECT $__timeGroupAlias(finished_at, $__interval),
                   avg(peak_kv_bytes) AS "mean",
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY peak_kv_bytes) AS "p99",
                   max(peak_kv_bytes) AS "max"
            FROM job_stats WHERE $__timeFilter(finished_at) AND {model_filter()}
            GROUP BY 1 ORDER BY 1""", "timeseries", unit="bytes"),
        sql_panel(g, 5, "Jobs finished per status", f"""
            SELECT $__timeGroupAlias(finished_at, $__interval), status AS metric,
                   count(*) AS value
            FROM job_stats WHERE $__timeFilter(finished_at) AND {model_filter()}
            GROUP BY 1, 2 ORDER BY 1""", "timeseries"),
        sql_panel(g, 6, "Slowest jobs", f"""
            SELECT job_id, batch_id, model, e2e_s, ttft_s, queue_wait_s, prompt_tokens,
                   cached_prompt_tokens, generated_tokens, preemptions, peak_kv_bytes,
                   worker_id, finished_at
            FROM job_stats
            WHERE $__timeFilter(finished_at) AND status = 'succeeded' AND {model_filter()}
            ORDER BY e2e_s DESC NULLS LAST LIMIT 25""", "table", w=24),
        sql_panel(g, 7, "Failures with reasons", f"""
            SELECT s.status, left(j.error, 160) AS reason, count(*) AS jobs,
                   max(s.finished_at) AS last_seen
            FROM job_stats s JOIN jobs j ON j.id = s.job_id
            WHERE $__timeFilter(s.finished_at) AND s.status <> 'succeeded'
                  AND {model_filter('s.model')}
            GROUP BY 1, 2 ORDER BY jobs DESC LIMIT 50""", "table", w=24),
    ]
    variables = [{
        "name": "model", "label": "model", "type": "query", "datasource": PG,
        "query": MODELS_SQL, "definition": MODELS_SQL,
        "includeAll": True, "allValue": ALL_MODELS, "multi": True, "refresh": 2,
        "current": {"text": "All", "value": "$__all"},
    }]
    return dashboard("kvbatch-jobs", "kvbatch / Jobs", panels, variables, "1m", "now-24h")


def dashboard(uid: str, title: str, panels: list[dict[str, Any]],
              variables: list[dict[str, Any]], refresh: str, since: str) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "tags": ["kvbatch"], "timezone": "utc",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": refresh,
        "time": {"from": since, "to": "now"},
        "templating": {"list": variables}, "annotations": {"list": []},
        "panels": panels,
    }


def main() -> None:
    for name, board in (("kvbatch-overview.json", overview()), ("kvbatch-jobs.json", jobs())):
        (OUT / name).write_text(json.dumps(board, indent=2) + "\n")


if __name__ == "__main__":
    main()
