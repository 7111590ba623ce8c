"""Observability end to end: a real Prometheus (the Debian package's binary, on 127.0.0.1)
scrapes a live worker through a short mixed workload, and every PromQL query of every dashboard
must return data; the recording rules and alerts pass ``promtool test rules``.

``.ci/run`` installs Prometheus when it is missing; without the binary these tests skip,
naming it."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from prometheus_client import start_http_server
from services import wait_until

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.schemas import JobSpec, JobStatus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
RULES = ROOT / "deploy" / "prometheus" / "rules"
RULE_TESTS = ROOT / "tests" / "deploy" / "prometheus" / "rules_test.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="the prometheus and promtool binaries (Debian package prometheus; .ci/run installs it)")
MODEL = "tiny"
SCRAPE_S = 1
RATE_INTERVAL = "15s"  # four scrape intervals and more, as Grafana's $__rate_interval is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES / "*.yml")],
            "scrape_configs": [{"job_name": "kvbatch-workers",
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'db'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("w"))
        wait_until(self.ready, 60, what="prometheus ready")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str, at: str | None = None) -> list[tuple[dict[str, str], float]]:
        data = self.api("query", query=expr, **({"time": at} if at else {}))
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def prometheus_on_a_worker(start_worker, tmp_path: Path) -> Iterator[tuple[Prometheus, Any]]:  # type: ignore[no-untyped-def]
    # A small KV pool (24 blocks of 8 tokens), so that the workload below preempts.
    running = start_worker(num_kv_blocks=24, max_num_seqs=8, max_model_len=192)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1",
                                       registry=running.worker.metrics.registry)
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        yield prom, running
    finally:
        prom.stop()
        server.shutdown()
        thread.join(10)


def prom_targets() -> list[tuple[str, str, bool]]:
    """(panel title, expr, instant) of every PromQL target of every dashboard."""
    found = []
    for board in DASHBOARDS.glob("*.json"):
        for panel in json.loads(board.read_text())["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == "prometheus":
                    found.append((panel["title"], t["expr"], bool(t["instant"])))
    return found


@needs_prometheus
def test_rules_and_alerts_pass_promtool() -> None:
    check = subprocess.run([str(PROMTOOL), "check", "rules", *map(str, RULES.glob("*.yml"))],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([str(PROMTOOL), "test", "rules", RULE_TESTS.name],
                          cwd=RULE_TESTS.parent, capture_output=True, text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


@needs_prometheus
def test_every_dashboard_query_returns_data_from_a_live_worker(
        prometheus_on_a_worker: tuple[Prometheus, Any], redis_client: redis.Redis, keys: Keys,
        pg_engine: sa.Engine) -> None:
    prom, running = prometheus_on_a_worker
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    started = time.time()
    # Counters exist at 0 before anything happens: the first event is a visible increase.
    wait_until(lambda: prom.instant(f'kvbatch_jobs_total{{model_name="{MODEL}"}}'), 30,
               what="first scrape")
    assert {m["status"] for m, _ in prom.instant("kvbatch_jobs_total")} == {
        "succeeded", "failed", "cancelled", "expired"}
    system = "You answer in one word. " * 3  # shared by every job: prefix-cache hits
    greedy = {"temperature": 0.0, "ignore_eos": True}
    specs = [JobSpec(model=MODEL, prompt=f"{system}Q{i}?",
                     sampling={**greedy, "max_tokens": 90 if i < 6 else 8}) for i in range(12)]
    too_long = JobSpec(model=MODEL, prompt="x" * 400, sampling=greedy)  # fails: max_model_len
    doomed = JobSpec(model=MODEL, prompt=f"{system}cancel me", sampling={**greedy,
                                                                         "max_tokens": 150})
    ids = client.submit([*specs, too_long, doomed])
    wait_until(lambda: client.get(doomed.id).status is JobStatus.RUNNING, 60, 0.05,
               what="job to cancel running")
    client.cancel(doomed.id)
    infos = {i.id: i for i in client.wait(ids, timeout_s=240)}
    statuses = {s: sum(i.status is s for i in infos.values()) for s in JobStatus}
    assert statuses[JobStatus.SUCCEEDED] == 12 and statuses[JobStatus.FAILED] == 1
    assert statuses[JobStatus.CANCELLED] == 1
    assert sum(i.stats.preemptions for i in infos.values() if i.stats) > 0
    time.sleep(4 * SCRAPE_S)  # the last scrapes; on a slow machine, until they count every job

    def scraped_all() -> bool:
        total = prom.instant(f'sum(kvbatch_jobs_total{{model_name="{MODEL}"}})')
        return bool(total) and round(total[0][1]) == len(ids)

    wait_until(scraped_all, 60, what="the last jobs scraped")
    window_s = math.ceil(time.time() - started) + 5

    def expand(expr: str) -> str:
        return (expr.replace("$model", MODEL).replace("$__rate_interval", RATE_INTERVAL)
                .replace("$__range", f"{window_s}s"))

    empty = []
    for title, expr, instant in prom_targets():
        if instant:
            values = [v for _, v in prom.instant(expand(expr))]
        else:
            data = prom.api("query_range", query=expand(expr), start=str(started),
                            end=str(time.time()), step="1")
            values = [float(v) for s in data["result"] for _, v in s["values"]]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr}")
    assert not empty, f"{len(empty)} of {len(prom_targets())} queries without data: {empty}"
    # The model variable (Grafana's label_values) lists the model.
    assert MODEL in prom.api("label/model_name/values", **{"match[]": "kvbatch_jobs_in_flight"})

    whole = f"{window_s}s"
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        p50, p90, p99 = (prom.instant(
            f"histogram_quantile({q}, sum by (le) (rate(kvbatch_{hist}_bucket[{whole}])))")[0][1]
            for q in (0.5, 0.9, 0.99))
        assert p50 <= p90 <= p99, (hist, p50, p90, p99)
    # Evaluated at the last scrape: increase() then extrapolates neither end (the series start
    # at 0, and the range ends on a sample), so it counts what happened, exactly.
    last = prom.api("query", query=f"kvbatch_jobs_total[{whole}]")["result"][0]["values"][-1][0]
    finished = prom.instant(
        f'sum(increase(kvbatch_jobs_total{{model_name="{MODEL}"}}[{whole}]))', at=str(last))
    with pg_engine.connect() as conn:
        terminal = conn.execute(sa.text(
            "SELECT count(*) FROM jobs WHERE status NOT IN ('queued', 'running')")).scalar()
    assert round(finished[0][1]) == terminal == len(ids)
    hit_rate = prom.instant(f"sum(increase(kvbatch_prefix_cache_hits_total[{whole}])) / "
                            f"sum(increase(kvbatch_prefix_cache_queries_total[{whole}]))")[0][1]
    assert 0 < hit_rate <= 1
    kv = [v for _, v in prom.instant(f"max_over_time(kvbatch_kv_cache_usage_perc[{whole}])")]
    assert kv and all(0 <= v <= 1 for v in kv)
    # vLLM's meaning: prompt_tokens counts whole prompts; the cached part is its own counter.
    prompt = prom.instant(f"sum(increase(kvbatch_prompt_tokens_total[{whole}]))", str(last))[0][1]
    cached = prom.instant(f"sum(increase(kvbatch_prompt_tokens_cached_total[{whole}]))",
                          str(last))[0][1]
    # Counted when a request is first scheduled, as vLLM does: not for a job cancelled while it
    # waited in the engine (queue_wait_s is None then), nor for one refused when added.
    scheduled = sum(i.stats.prompt_tokens for i in infos.values()
                    if i.stats and i.stats.queue_wait_s is not None)
    assert round(prompt) == scheduled and 0 < cached < prompt
    assert running.thread.is_alive()
