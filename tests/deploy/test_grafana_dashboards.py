"""Every Grafana panel's query is checked: Prometheus expressions may only name metrics (and
labels) the worker's registry exports; SQL panels run against the real ``job_stats`` view on a
migrated PostgreSQL schema with Grafana's macros expanded, and so do the BI queries in
docs/bi-queries.md."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from services import PG_URL, all_roles_store
from sqlalchemy import Engine, text
from sqlalchemy.exc import ProgrammingError

from jobs import db
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome
from worker.metrics import WorkerMetrics

SQL = all_roles_store()

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
ROLE_SQL = ROOT / "deploy" / "postgres" / "reader-role.sql"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "kvbatch.yml"
METRIC = re.compile(r"kvbatch_[A-Za-z0-9_]+")


def boards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


PROM_TYPE, PG_TYPE = "prometheus", "grafana-postgresql-datasource"


def all_targets() -> list[tuple[str, str, dict[str, Any]]]:
    """(board file, panel title, target) of every panel of every dashboard."""
    return [(name, panel["title"], t) for name, board in boards().items()
            for panel in board["panels"] for t in panel["targets"]]


def targets(ds_type: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name}: {title}", t) for name, title, t in all_targets()
            if t["datasource"]["type"] == ds_type]


def exported() -> tuple[dict[str, str], set[str]]:
    """Series names the worker's registry exposes, each with its kind (``gauge``, ``counter``
    for counters' ``_total`` and histograms' ``_sum`` / ``_count``, ``bucket``), and the label
    names (every labelled metric touched once, so that it has samples)."""
    metrics = WorkerMetrics("m")  # labelled counters exist at 0 for every status they take
    names: dict[str, str] = {}
    labels = {"instance", "job"}  # the two Prometheus adds to every target
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps, not for queries
            if family.type == "gauge":
                kind = "gauge"
            elif family.type == "histogram" and sample.name.endswith("_bucket"):
                kind = "bucket"
            else:
                assert family.type in ("counter", "histogram"), family.type
                kind = "counter"
            names[sample.name] = kind
            labels |= set(sample.labels)
    return names, labels


RATES = {"rate", "irate", "increase"}


def enclosing_calls(expr: str) -> list[tuple[str, list[str]]]:
    """Each metric name in ``expr`` with the functions around it, innermost last (aggregation
    clauses such as ``by (le)`` do not count)."""
    found, stack, i = [], [], 0
    while i < len(expr):
        if m := METRIC.match(expr, i):
            found.append((m[0], [f for f in stack if f]))
            i = m.end()
            continue
        c = expr[i]
        if c == "(":
            name = re.search(r"([A-Za-z_]\w*)\s*$", expr[:i])
            stack.append(name[1] if name and name[1] not in ("by", "without") else "")
        elif c == ")":
            stack.pop()
        i += 1
    assert not stack, f"unbalanced: {expr!r}"
    return found


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
            "Jobs by terminal status (time range, all models)"} <= titles


def prometheus_queries() -> list[tuple[str, str]]:
    queries = [(title, t["expr"]) for title, t in targets(PROM_TYPE)]
    for name, board in boards().items():
        queries += [(f"{name}: variable {v['name']}", v["query"]["query"])
                    for v in board["templating"]["list"] if v["datasource"]["type"] == PROM_TYPE]
    return queries


def sql_queries() -> list[tuple[str, str]]:
    queries = [(title, t["rawSql"]) for title, t in targets(PG_TYPE)]
    for name, board in boards().items():
        queries += [(f"{name}: variable {v['name']}", v["query"])
                    for v in board["templating"]["list"] if v["datasource"]["type"] == PG_TYPE]
    return queries


def test_every_panel_target_is_checked() -> None:
    """Each target of each dashboard is a Prometheus or PostgreSQL query, and so is checked by
    the tests below; stat and bar-gauge panels over Prometheus query one instant."""
    every = all_targets()
    assert {t["datasource"]["type"] for _, _, t in every} == {PROM_TYPE, PG_TYPE}
    assert len(targets(PROM_TYPE)) + len(targets(PG_TYPE)) == len(every)
    assert all(t.get("expr") for _, t in targets(PROM_TYPE))
    assert all(t.get("rawSql") for _, t in targets(PG_TYPE))
    for board in boards().values():
        for panel in board["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == PROM_TYPE:
                    assert t["instant"] == (panel["type"] != "timeseries"), panel["title"]
                    assert t["range"] == (panel["type"] == "timeseries"), panel["title"]
                    assert "$__range" not in t["expr"] or t["instant"], panel["title"]


def test_every_prometheus_query_names_exported_metrics_and_labels() -> None:
    names, labels = exported()
    queries = prometheus_queries()
    assert len(queries) > 12
    for title, expr in queries:
        used = set(METRIC.findall(expr))
        assert used, f"{title}: no kvbatch metric in {expr!r}"
        assert used <= set(names), f"{title}: not exported: {sorted(used - set(names))}"
        matchers = {m for sel in re.findall(r"\{([^}]*)\}", expr)
                    for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)}
        grouped = {g.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr)
                   for g in by.split(",")}
        label_values = set(re.findall(r"label_values\([^,]+,\s*(\w+)\)", expr))
        assert matchers | grouped | label_values <= labels, f"{title}: unknown label"
    # The hit rate is hits over queries, as rates.
    hit_rate = next(e for t, e in queries if t.endswith("Prefix-cache hit rate"))
    assert re.fullmatch(r"sum\(rate\(kvbatch_prefix_cache_hits_total.*\)\) / "
                        r"sum\(rate\(kvbatch_prefix_cache_queries_total.*\)\)", hit_rate)


def type_errors(expr: str, names: dict[str, str]) -> list[str]:
    """What is wrong with how ``expr`` uses each metric, given the metrics' kinds."""
    errors = []
    for metric, calls in enclosing_calls(expr):
        kind, rated = names[metric], bool(RATES & set(calls))
        quantile = "histogram_quantile" in calls
        if kind == "gauge" and (rated or quantile):
            errors.append(f"gauge {metric} under {calls}")
        elif kind == "counter" and (not rated or quantile):
            errors.append(f"counter {metric} not rated, or under histogram_quantile")
        elif kind == "bucket" and not (rated and quantile):
            errors.append(f"bucket {metric} outside histogram_quantile(rate(...))")
    for inner in re.findall(r"histogram_quantile\([^,]+,(.*)\)", expr):
        if not re.search(r"\bby \([^)]*\ble\b", inner):
            errors.append("histogram_quantile not grouped by le")
    return errors


def test_prometheus_functions_match_the_metric_types() -> None:
    """rate/increase only over counters and histogram buckets, histogram_quantile only over
    buckets grouped by ``le``, gauges never rated, counters never graphed raw."""
    names, _ = exported()
    kinds = set()
    for title, expr in prometheus_queries():
        if expr.startswith("label_values("):
            continue
        assert not type_errors(expr, names), f"{title}: {type_errors(expr, names)}"
        kinds |= {names[m] for m in METRIC.findall(expr)}
    assert kinds == {"gauge", "counter", "bucket"}


def test_the_type_check_catches_misuse() -> None:
    names, _ = exported()
    bucket = "kvbatch_e2e_request_latency_seconds_bucket"
    for expr in ("rate(kvbatch_num_requests_running[5m])",
                 "sum(kvbatch_jobs_total)",
                 "max(kvbatch_jobs_total) - sum(increase(kvbatch_jobs_total[1h]))",
                 f"histogram_quantile(0.5, sum by (le) ({bucket}))",
                 f"histogram_quantile(0.5, sum(rate({bucket}[5m])))",
                 f"sum(rate({bucket}[5m]))",
                 "histogram_quantile(0.5, sum by (le) (rate(kvbatch_jobs_total[5m])))"):
        assert type_errors(expr, names), expr
    assert not type_errors(f"histogram_quantile(0.5, sum by (le) (rate({bucket}[5m])))", names)


# -- SQL: run every query against the real view --------------------------------------------

def render(sql: str, model: str = "'m'") -> str:
    """Expand the Grafana macros and variables the dashboards use, as Grafana would; ``model``
    is the `model` variable as Grafana inserts it (``'__all'``: "All" selected)."""
    sql = re.sub(r"\$__timeGroupAlias\(([\w.]+),\s*\$__interval\)",
                 lambda m: f"date_trunc('minute', {m[1]}) AS \"time\"", sql)
    sql = re.sub(r"\$__timeFilter\(([\w.]+)\)",
                 r"\1 BETWEEN now() - interval '1 day' AND now() + interval '1 minute'", sql)
    sql = sql.replace("$model", model)
    assert "$" not in sql, sql
    return sql


def seed(engine: Engine) -> None:
    """Two batches' worth of finished jobs (successes, a failure, an expiry) and a queued one;
    a third batch of another model with nothing finished yet."""
    store = SQL(engine)
    now = time.time()
    specs = [JobSpec(id=f"j{i}", batch_id=f"b{i % 2}", custom_id=str(i), model="m",
                     prompt="p", submitted_at=now - 300) for i in range(8)]
    specs.append(JobSpec(id="other", batch_id="b-other", model="other", prompt="p",
                         submitted_at=now - 300))
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


@pytest.fixture
def seeded(pg_engine: Engine) -> Engine:
    seed(pg_engine)
    return pg_engine


@pytest.fixture
def reader(pg_engine: Engine, pg_url: str) -> Iterator[Engine]:
    """The read-only role of deploy/postgres/reader-role.sql, created by the script itself in
    the test's schema (then dropped), and an engine logged in as it."""
    role = f"kvb_reader_{uuid.uuid4().hex[:10]}"
    schema = pg_url.rsplit("%3D", 1)[1]
    server = PG_URL.replace("postgresql+psycopg://", "postgresql://")
    env = {**os.environ, "GRAFANA_DB_USER": role, "GRAFANA_DB_PASSWORD": "it's \"quoted\";"}
    for _ in range(2):  # idempotent: the compose service runs it after every migration
        done = subprocess.run(["psql", server, "--no-psqlrc", "--quiet", f"--set=schema={schema}",
                               "--file", str(ROLE_SQL)], env=env, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    engine = db.make_engine(pg_url.replace("postgres@", f"{role}@", 1))
    yield engine
    engine.dispose()
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP OWNED BY "{role}"'))
        conn.execute(text(f'DROP ROLE "{role}"'))


def test_every_sql_query_runs_as_the_read_only_role(pg_engine: Engine, reader: Engine) -> None:
    """On a fresh install (no jobs, no models: "All" must still work), then on seeded data,
    with "All" and with one model selected; as the role Grafana logs in as."""
    queries = sql_queries()
    assert len(queries) >= 9
    with reader.connect() as conn:
        for _title, sql in queries:
            conn.execute(text(render(sql, "'__all'"))).all()
    seed(pg_engine)
    with reader.connect() as conn:
        view_columns = set(conn.execute(text("SELECT * FROM job_stats LIMIT 0")).keys())
        for title, sql in queries:
            assert re.search(r"\bjob_stats\b|\bFROM jobs\b", sql), f"{title}: reads what?"
            for model in ("'m'", "'__all'"):
                rows = conn.execute(text(render(sql, model))).mappings().all()
                assert rows, f"{title}: no rows on seeded data"
                if "time" in rows[0]:  # time series: Grafana needs a time column and numbers
                    assert all(r["time"] is not None for r in rows), title
    assert {"job_id", "e2e_s", "cached_prompt_tokens", "peak_kv_bytes"} <= view_columns


def test_the_read_only_role_cannot_read_payloads(seeded: Engine, reader: Engine) -> None:
    for sql in ("SELECT text FROM jobs", "SELECT spec FROM jobs", "SELECT token_ids FROM jobs",
                "SELECT * FROM jobs", "SELECT webhook_url FROM batches",
                "SELECT metadata FROM batches", "SELECT * FROM job_metrics"):
        with reader.connect() as conn, pytest.raises(ProgrammingError, match="permission"):
            conn.execute(text(sql))
    with reader.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_stats")).scalar() == 7


def test_batch_progress_and_failures_read_right(seeded: Engine) -> None:
    by_title = {t.split(": ", 1)[1]: sql for t, sql in sql_queries()}
    with seeded.connect() as conn:
        progress = {r["batch"]: r for r in
                    conn.execute(text(render(by_title["Batch progress"]))).mappings()}
        everything = {r["batch"] for r in
                      conn.execute(text(render(by_title["Batch progress"], "'__all'")))
                      .mappings()}
        failures = conn.execute(text(render(by_title["Failures with reasons"]))).mappings().all()
        statuses = dict(conn.execute(text(render(
            by_title["Jobs by terminal status (time range, all models)"]))).all())
        models = conn.execute(text(by_title["variable model"])).scalars().all()
    # b0: j0 j2 j4 succeeded, j6 expired; b1: j1 j3 succeeded, j5 failed, j7 queued.
    assert (progress["b0"]["finished"], progress["b0"]["succeeded"]) == (4, 3)
    assert (progress["b1"]["num_jobs"], progress["b1"]["finished"], progress["b1"]["failed"],
            float(progress["b1"]["pct_done"])) == (4, 3, 1, 75.0)
    assert set(progress) == {"b0", "b1"}
    # A model with no finished job yet is selectable, and its batch shows under "All".
    assert everything == {"b0", "b1", "b-other"} and models == ["m", "other"]
    assert {(r["status"], r["reason"], r["jobs"]) for r in failures} == {
        ("failed", "rejected: ValueError: long", 1), ("expired", "deadline passed", 1)}
    assert statuses == {"succeeded": 5, "failed": 1, "expired": 1}


def test_bi_queries_in_the_docs_run_as_the_read_only_role(seeded: Engine,
                                                          reader: Engine) -> None:
    doc = (ROOT / "docs" / "bi-queries.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", doc, flags=re.S)
    assert len(blocks) >= 6
    with reader.connect() as conn:
        for sql in blocks:
            assert conn.execute(text(sql)).mappings().all(), sql
