"""Every Grafana panel's query is checked: Prometheus expressions may only name metrics (and
labels) the worker's registry exports; SQL panels run against the real ``job_stats`` view on a
migrated PostgreSQL schema with Grafana's macros expanded, and so do the BI queries in
docs/bi-queries.md."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine, text

from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus
from jobs.store import JobStore, Outcome
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "kvbatch.yml"
METRIC = re.compile(r"kvbatch:[A-Za-z0-9_:]+")


def boards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def targets(board: dict[str, Any], ds_type: str) -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], t) for panel in board["panels"] for t in panel["targets"]
            if t["datasource"]["type"] == ds_type]


def exported() -> tuple[set[str], set[str]]:
    """Series names and label names the worker's registry exposes (every labelled metric
    touched once, so that it has samples)."""
    metrics = WorkerMetrics("m")
    for status in JobStatus:
        metrics.job_finished(status.value)
    names, labels = set(), {"instance", "job"}  # the two Prometheus adds to every target
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def test_dashboards_are_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location(
        "kvbatch_make_dashboards", ROOT / "deploy" / "grafana" / "make_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert boards() == {"kvbatch-jobs.json": module.jobs(),
                        "kvbatch-overview.json": module.overview()}


def test_dashboards_parse_and_use_the_provisioned_datasources() -> None:
    provisioned = {d["uid"]: d["type"] for d in yaml.safe_load(DATASOURCES.read_text())
                   ["datasources"]}
    got = boards()
    assert {b["title"] for b in got.values()} == {"kvbatch / Overview", "kvbatch / Jobs"}
    for board in got.values():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), board["title"]
        for panel in board["panels"]:
            assert panel["targets"], panel["title"]
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, panel["title"]
            for t in [panel, *panel["targets"]]:
                assert provisioned.get(t["datasource"]["uid"]) == t["datasource"]["type"]


def test_overview_covers_the_required_views() -> None:
    titles = {p["title"] for p in boards()["kvbatch-overview.json"]["panels"]}
    assert {"Jobs running / waiting", "Queue depth", "Throughput", "Time to first token",
            "Inter-token latency", "End-to-end latency", "KV-cache usage",
            "Prefix-cache hit rate", "Preemptions",
            "Jobs by terminal status (time range)"} <= titles


def test_every_prometheus_query_names_exported_metrics_and_labels() -> None:
    names, labels = exported()
    board = boards()["kvbatch-overview.json"]
    queries = [(title, t["expr"]) for title, t in targets(board, "prometheus")]
    queries += [("variable " + v["name"], v["query"]["query"])
                for v in board["templating"]["list"]]
    assert len(queries) > 12
    for title, expr in queries:
        used = set(METRIC.findall(expr))
        assert used, f"{title}: no kvbatch metric in {expr!r}"
        assert used <= names, f"{title}: not exported: {sorted(used - names)}"
        matchers = {m for sel in re.findall(r"\{([^}]*)\}", expr)
                    for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)}
        grouped = {g.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr)
                   for g in by.split(",")}
        label_values = set(re.findall(r"label_values\([^,]+,\s*(\w+)\)", expr))
        assert matchers | grouped | label_values <= labels, f"{title}: unknown label"
    # The hit rate is hits over queries, as rates.
    hit_rate = next(e for t, e in queries if t == "Prefix-cache hit rate")
    assert re.fullmatch(r"sum\(rate\(kvbatch:prefix_cache_hits_total.*\)\) / "
                        r"sum\(rate\(kvbatch:prefix_cache_queries_total.*\)\)", hit_rate)


# -- SQL: run every query against the real view --------------------------------------------

def render(sql: str) -> str:
    """Expand the Grafana macros and variables the dashboards use, as Grafana would."""
    sql = re.sub(r"\$__timeGroupAlias\(([\w.]+),\s*\$__interval\)",
                 lambda m: f"date_trunc('minute', {m[1]}) AS \"time\"", sql)
    sql = re.sub(r"\$__timeFilter\(([\w.]+)\)",
                 r"\1 BETWEEN now() - interval '1 day' AND now() + interval '1 minute'", sql)
    sql = sql.replace("$model", "'m'")
    assert "$" not in sql, sql
    return sql


@pytest.fixture
def seeded(pg_engine: Engine) -> Engine:
    """Two batches' worth of finished jobs (successes, a failure, an expiry) and a queued one."""
    store = JobStore(pg_engine)
    now = time.time()
    specs = [JobSpec(id=f"j{i}", batch_id=f"b{i % 2}", custom_id=str(i), model="m",
                     prompt="p", submitted_at=now - 300) for i in range(8)]
    store.insert_jobs(specs)
    outcomes = [
        Outcome(f"j{i}", JobStatus.SUCCEEDED, now - 10 * i,
                result=JobResult(text="t", token_ids=[1], finish_reason="stop"),
                stats=JobStats(queue_wait_s=0.1 * i, ttft_s=0.2 + i, tpot_s=0.01, e2e_s=1.0 + i,
                               prompt_tokens=100, cached_prompt_tokens=64 if i % 2 else 0,
                               generated_tokens=20, peak_kv_blocks=8,
                               peak_kv_bytes=8 * 737280, preemptions=i % 3))
        for i in range(5)
    ]
    outcomes.append(Outcome("j5", JobStatus.FAILED, now, error="rejected: ValueError: long"))
    outcomes.append(Outcome("j6", JobStatus.EXPIRED, now, error="deadline passed"))
    store.finish(outcomes, worker_id="w1")
    return pg_engine


def sql_queries() -> list[tuple[str, str]]:
    board = boards()["kvbatch-jobs.json"]
    queries = [(title, t["rawSql"]) for title, t in targets(board, "grafana-postgresql-datasource")]
    return queries + [("variable " + v["name"], v["query"]) for v in board["templating"]["list"]]


def test_every_sql_panel_runs_against_the_job_stats_view(seeded: Engine) -> None:
    queries = sql_queries()
    assert len(queries) >= 8
    with seeded.connect() as conn:
        view_columns = set(conn.execute(text("SELECT * FROM job_stats LIMIT 0")).keys())
        for title, sql in queries:
            assert re.search(r"\bjob_stats\b", sql), f"{title}: does not read job_stats"
            rows = conn.execute(text(render(sql))).mappings().all()
            assert rows, f"{title}: no rows on seeded data"
            if "time" in rows[0]:  # time series: Grafana needs a time column and numbers
                assert all(r["time"] is not None for r in rows), title
    assert {"job_id", "e2e_s", "cached_prompt_tokens", "peak_kv_bytes"} <= view_columns


def test_batch_progress_and_failures_read_right(seeded: Engine) -> None:
    by_title = dict(sql_queries())
    with seeded.connect() as conn:
        progress = {r["batch"]: r for r in
                    conn.execute(text(render(by_title["Batch progress"]))).mappings()}
        failures = conn.execute(text(render(by_title["Failures with reasons"]))).mappings().all()
    # b0: j0 j2 j4 succeeded, j6 expired; b1: j1 j3 succeeded, j5 failed, j7 queued.
    assert (progress["b0"]["finished"], progress["b0"]["succeeded"]) == (4, 3)
    assert (progress["b1"]["num_jobs"], progress["b1"]["finished"], progress["b1"]["failed"],
            float(progress["b1"]["pct_done"])) == (4, 3, 1, 75.0)
    assert {(r["status"], r["reason"], r["jobs"]) for r in failures} == {
        ("failed", "rejected: ValueError: long", 1), ("expired", "deadline passed", 1)}


def test_bi_queries_in_the_docs_run(seeded: Engine) -> None:
    doc = (ROOT / "docs" / "bi-queries.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", doc, flags=re.S)
    assert len(blocks) >= 6
    with seeded.connect() as conn:
        for sql in blocks:
            assert conn.execute(text(sql)).mappings().all(), sql
