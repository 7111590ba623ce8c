"""Faults on real processes and real services; every loop is bounded and stops by itself.

Each test ends with the audit: every submitted job terminal with exactly one ``job_metrics``
row (none lost, none duplicated). ``KVBATCH_SOAK=1`` makes the kill loop longer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from chaos import MODEL, audit, wait_until
from services import SOAK, all_roles_store

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.feed import MIN_WINDOW
from jobs.queue import JobQueue
from jobs.schemas import JobSpec, JobStatus

SQL = all_roles_store()

FIGURES = Path(os.environ.get("KVBATCH_RELIABILITY_FIGURES", "/tmp/kvbatch-reliability.json"))


def record(name: str, **figures: object) -> None:
    """Append this run's figures (docs/reliability.md quotes them)."""
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data[name] = figures
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True))


def _greedy(i: int, max_tokens: int) -> JobSpec:
    return JobSpec(model=MODEL, prompt=f"reliability job {i}: " + "abc " * (i % 7),
                   sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})


def _reference(tiny_model: str, specs: list[JobSpec]) -> dict[str, list[int]]:
    """Greedy outputs of the same prompts from the engine alone, without any fault."""
    from worker.main import build_engine
    from worker.settings import worker_settings

    engine = build_engine(worker_settings(model=tiny_model, device="cpu", num_kv_blocks=512,
                                          max_num_seqs=16))
    outs = engine.generate([s.engine_prompt(chat=engine.has_chat_template) for s in specs],
                           [s.sampling for s in specs])
    return {s.id: list(o.outputs[0].token_ids) for s, o in zip(specs, outs, strict=True)}


def _all_terminal(client: JobClient, ids: list[str]) -> bool:
    return len(SQL(client.engine).terminal_ids(ids)) == len(ids)


def _running_or_done(client: JobClient, ids: list[str]) -> bool:
    return bool(SQL(client.engine).count_by_status(model=MODEL).get(JobStatus.RUNNING)) or \
        _all_terminal(client, ids)


def test_sigkill_at_random_moments(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                                   workers, tiny_model: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    n_jobs, n_kills = (600, 20) if SOAK else (100, 3)
    specs = [_greedy(i, max_tokens=rng.choice((32, 256, 640))) for i in range(n_jobs)]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    # Workers first, with small windows: most jobs wait in the SQL backlog and are fed while
    # workers are killed (feeding is part of what must be exactly-once).
    procs = {name: workers.start(name, feed_window=24) for name in ("w-a", "w-b")}
    _wait_for_window(redis_client, keys, 48)
    ids = client.submit(specs)
    wait_until(lambda: SQL(client.engine).count_by_status(model=MODEL).get(JobStatus.RUNNING), 60,
               what="first job running")
    kills = 0
    while kills < n_kills and not _all_terminal(client, ids):
        time.sleep(rng.uniform(0.2, 2.5))  # pulling, generating, storing, acking: any moment
        name = rng.choice(sorted(procs))
        procs[name].signal(signal.SIGKILL)
        procs[name].proc.wait(10)
        kills += 1
        # Half the restarts reuse the worker id (it takes back its own pending entries), half
        # come back under a new one (the survivors claim the dead one's entries).
        new_name = name if kills % 2 else f"{name}-{kills}"
        del procs[name]
        procs[new_name] = workers.start(new_name, feed_window=24)
    wait_until(lambda: _all_terminal(client, ids), 240, interval_s=0.5, what="all terminal")
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    infos = {i.id: i for i in client.get_many(ids)}
    assert {i.status for i in infos.values()} == {JobStatus.SUCCEEDED}, result.by_status
    reference = _reference(tiny_model, specs)
    mismatched = [j for j in ids if infos[j].result.token_ids != reference[j]]
    assert not mismatched, f"{len(mismatched)} results differ from the fault-free run"
    retried = sum(1 for i in infos.values() if i.attempts > 1)
    assert JobQueue(redis_client, MODEL, keys).depth()[0] == 0
    record("sigkill", jobs=n_jobs, kills=kills, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows, retried_jobs=retried,
           results_equal_reference=n_jobs - len(mismatched))


def test_death_between_sql_commit_and_xack(redis_client: redis.Redis, keys: Keys,
                                           pg_engine: sa.Engine, workers,
                                           tiny_model: str) -> None:  # type: ignore[no-untyped-def]
    """The narrowest window: results stored, entries not acknowledged. The next worker must
    find them done (no second run, no second terminal row) and acknowledge them."""
    specs = [_greedy(i, max_tokens=8) for i in range(40)]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit(specs)
    crashing = workers.start("w-commit", probes=["--die-after-commit"])
    assert crashing.proc.wait(120) == 137, crashing.log()[-2000:]
    stored = SQL(client.engine).terminal_ids(ids)
    queue = JobQueue(redis_client, MODEL, keys)
    assert stored and queue.depth()[1] >= len(stored)  # stored, still pending: never acked
    workers.start("w-next")
    wait_until(lambda: _all_terminal(client, ids), 120, interval_s=0.5, what="all terminal")
    wait_until(lambda: queue.depth() == (0, 0), 30, what="stream drained")
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    infos = {i.id: i for i in client.get_many(ids)}
    assert {i.status for i in infos.values()} == {JobStatus.SUCCEEDED}
    reference = _reference(tiny_model, specs)
    assert all(infos[j].result.token_ids == reference[j] for j in ids)
    # Jobs stored before the crash were not run again: one attempt, their first worker's row.
    assert all(infos[j].attempts == 1 and infos[j].worker_id == "w-commit" for j in stored)
    record("exit_after_commit", jobs=len(ids), stored_before_exit=len(stored),
           lost=result.lost, duplicate_terminal_rows=result.duplicate_terminal_rows)


def test_redis_restart_with_data_loss(own_redis, keys: Keys, pg_engine: sa.Engine, pg_url: str,
                                      tiny_model: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from chaos import WorkerProcs

    n_jobs, n_restarts = (400, 5) if SOAK else (120, 2)
    rc = redis.Redis.from_url(own_redis.url, decode_responses=True)
    client = JobClient(rc, pg_engine, key_prefix=keys.prefix)
    procs = WorkerProcs(tiny_model, keys, own_redis.url, pg_url, tmp_path / "logs")
    try:
        for name in ("r-a", "r-b"):  # small windows: most jobs wait in the SQL backlog
            procs.start(name, reconcile_interval_s=1.0, reconcile_grace_s=1.0, feed_window=24)
        _wait_for_window(rc, keys, 48)
        ids = client.submit([_greedy(i, max_tokens=400) for i in range(n_jobs)])
        for _ in range(n_restarts):
            wait_until(lambda: _running_or_done(client, ids), 90, what="jobs running")
            if _all_terminal(client, ids):
                break
            time.sleep(1.0)
            own_redis.restart_empty()  # every stream entry, lease and marker is gone
        wait_until(lambda: _all_terminal(client, ids), 180, interval_s=0.5, what="all terminal")
        assert all(w.alive() for w in procs.procs), "a worker died with Redis"
    finally:
        procs.kill_all()
        rc.close()
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    assert result.by_status == {"succeeded": n_jobs}, result.by_status
    record("redis_restart", jobs=n_jobs, restarts=own_redis.restarts, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows)


def _wait_for_window(client: redis.Redis, keys: Keys, size: int) -> None:
    """Until the live workers' windows add up to ``size`` (both have registered)."""
    queue = JobQueue(client, MODEL, keys)
    wait_until(lambda: queue.window(MIN_WINDOW) == size, 120, what="workers' windows")


def _pg_restart() -> None:
    version = subprocess.run(["ls", "/etc/postgresql"], capture_output=True, text=True,
                             check=True).stdout.split()[0]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
                   check=True, capture_output=True, timeout=120)


@pytest.mark.pg_restart
def test_postgres_restart(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                          workers) -> None:  # type: ignore[no-untyped-def]
    n_jobs, n_restarts = (400, 4) if SOAK else (120, 2)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_greedy(i, max_tokens=400) for i in range(n_jobs)])
    for name in ("p-a", "p-b"):
        workers.start(name)
    restarts = 0
    try:
        for _ in range(n_restarts):
            wait_until(lambda: _running_or_done(client, ids), 90, what="jobs running")
            if _all_terminal(client, ids):
                break
            time.sleep(0.5)
            _pg_restart()
            restarts += 1
            pg_engine.dispose()
    finally:
        subprocess.run(["pg_isready", "-h", "127.0.0.1", "-t", "30"], check=False)
    wait_until(lambda: _all_terminal(client, ids), 180, interval_s=0.5, what="all terminal")
    assert all(w.alive() for w in workers.procs), "a worker died with PostgreSQL"
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    assert result.by_status == {"succeeded": n_jobs}, result.by_status
    wait_until(lambda: JobQueue(redis_client, MODEL, keys).depth() == (0, 0), 30,
               what="stream drained")
    record("postgres_restart", jobs=n_jobs, restarts=restarts, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows)


def test_sigstopped_worker_loses_its_lease(redis_client: redis.Redis, keys: Keys,
                                           pg_engine: sa.Engine, workers) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_greedy(i, max_tokens=1500) for i in range(4)])
    hung = workers.start("hung")
    wait_until(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING}, 60,
               what="running on the first worker")
    hung.signal(signal.SIGSTOP)
    live = workers.start("live")
    wait_until(lambda: _all_terminal(client, ids), 120, what="finished by the live worker")
    infos = client.get_many(ids)
    assert {(i.status, i.worker_id, i.attempts) for i in infos} == {
        (JobStatus.SUCCEEDED, "live", 2)}
    hung.signal(signal.SIGCONT)  # it resumes mid-generation, finishes, tries to store
    time.sleep(6.0)
    assert hung.alive() and live.alive()
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    assert {(i.worker_id, i.attempts) for i in client.get_many(ids)} == {("live", 2)}
    wait_until(lambda: JobQueue(redis_client, MODEL, keys).depth() == (0, 0), 30,
               what="stream drained")
    record("sigstop", jobs=len(ids), stopped_workers=1, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows)


def test_sigterm_under_load(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                            workers) -> None:  # type: ignore[no-untyped-def]
    n_jobs = 300 if SOAK else 100
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_greedy(i, max_tokens=200) for i in range(n_jobs)])
    leaving = workers.start("leaving", drain_timeout_s=1.0)
    workers.start("staying")
    wait_until(lambda: SQL(client.engine).count_by_status(model=MODEL).get(JobStatus.SUCCEEDED), 90,
               what="first results")
    leaving.signal(signal.SIGTERM)
    assert leaving.proc.wait(30) == 0
    wait_until(lambda: _all_terminal(client, ids), 180, interval_s=0.5, what="all terminal")
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    assert result.by_status == {"succeeded": n_jobs}, result.by_status
    log = leaving.log()
    assert "handed back" in log or "draining" in log, log[-2000:]
    record("sigterm", jobs=n_jobs, terminated_workers=1, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows)
