"""Workers that die: SIGKILL mid-generation, and a poison job that crashes the engine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import redis
import sqlalchemy as sa
from services import child_pids
from worker_harness import long_job

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.queue import JobQueue
from jobs.schemas import JobSpec, JobStatus

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


def _worker_cmd(entry: list[str], tiny_model: str, keys: Keys, pg_url: str,
                *extra: str) -> list[str]:
    return [sys.executable, "-m", *entry, "--model", tiny_model, "--served-model-name", MODEL,
            "--redis-url", "redis://127.0.0.1:6379/0", "--database-url", pg_url,
            "--key-prefix", keys.prefix, "--device", "cpu", "--num-kv-blocks", "512", *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an exited child nobody reaped yet is not running


def test_sigkilled_worker_jobs_finish_on_another(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
    start_worker, wait_for, tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=1900) for i in range(6)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVBATCH_LEASE_TTL_S": "1.5"}
    port = _free_port()
    cmd = _worker_cmd(["worker"], tiny_model, keys, pg_url, "--worker-id", "doomed",
                      "--metrics-port", str(port))
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING}, 60)

        def all_six_in_the_engine() -> bool:  # mid-generation (the gauge follows its steps)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
            return b'kvbatch_num_requests_running{model_name="tiny"} 6.0' in metrics

        wait_for(all_six_in_the_engine, 30)
        (engine_pid,) = child_pids(proc.pid)  # the engine process
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not _running(engine_pid), 10)  # it leaves with its worker
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {i.worker_id for i in client.get_many(ids)} == {"doomed"}
    survivor = start_worker()  # lease_ttl_s 1.5: the dead worker's lease is over by now or soon
    sid = survivor.worker.worker_id
    # Claimed once the lease lapses (1.5 s, then a claim interval); the ceiling only catches
    # a survivor that never claims them.
    wait_for(lambda: {(i.worker_id, i.attempts) for i in client.get_many(ids)} == {(sid, 2)},
             timeout_s=60)
    infos = client.wait(ids, timeout_s=90)
    assert all(i.status is JobStatus.SUCCEEDED for i in infos), [i.error for i in infos]
    assert all(len(i.result.token_ids) == 1900 and i.attempts == 2 for i in infos)
    assert {i.worker_id for i in infos} == {sid}
    with pg_engine.connect() as conn:
        per_job = conn.execute(sa.text(
            "SELECT job_id, count(*) FROM job_stats GROUP BY job_id")).all()
    assert sorted(j for j, _ in per_job) == sorted(ids) and {n for _, n in per_job} == {1}
    wait_for(lambda: JobQueue(redis_client, MODEL, keys).depth() == (0, 0), 5)


def test_sigterm_drains_then_hands_back(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
    wait_for, tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=1900) for i in range(3)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVBATCH_DRAIN_TIMEOUT_S": "0.5"}
    cmd = _worker_cmd(["worker.cli", "worker"], tiny_model, keys, pg_url)  # `kvbatch worker`
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING}, 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for info in client.get_many(ids):
        assert (info.status, info.attempts, info.worker_id) == (JobStatus.QUEUED, 0, None)
    q = JobQueue(redis_client, MODEL, keys)
    assert q.depth() == (0, 3) and q.live_workers() == set()  # pending, lease given up


class PoisonEngine:
    """Wraps the engine; ``step()`` raises while a request whose prompt contains "poison" is
    in it, like a kernel bug triggered by one input."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine
        self.poisoned: set[str] = set()

    def add_request(self, request_id, prompt, params, **kw) -> None:  # type: ignore[no-untyped-def]
        self.engine.add_request(request_id, prompt, params, **kw)
        if "poison" in str(prompt):
            self.poisoned.add(request_id)

    def step(self):  # type: ignore[no-untyped-def]
        if self.poisoned:
            raise RuntimeError("kernel fault")
        return self.engine.step()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.engine, name)


def test_poison_job_ends_in_dead_letter_stream(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    (poison,) = client.submit([JobSpec(model=MODEL, prompt="poison pill")])
    for attempt in (1, 2):  # each delivery crashes its worker, which exits with status 1
        crashed = start_worker(engine_wrapper=PoisonEngine, max_deliveries=2)
        crashed.thread.join(30)
        assert crashed.rc == 1 and client.get(poison).attempts == attempt
    healthy = start_worker(engine_wrapper=PoisonEngine, max_deliveries=2)
    (info,) = client.wait([poison], timeout_s=30)
    assert info.status is JobStatus.FAILED and "dead-lettered" in info.error
    ((_, dead),) = redis_client.xrange(keys.dead_letter(MODEL))
    assert dead["id"] == poison and "delivered more than 2 times" in dead["reason"]
    # The worker that dead-lettered it keeps serving.
    (ok,) = client.wait(client.submit([JobSpec(model=MODEL, prompt="fine")]), timeout_s=30)
    assert ok.status is JobStatus.SUCCEEDED
    assert healthy.stop() == 0


def test_engine_process_killed_worker_exits_and_jobs_move_on(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
    start_worker, wait_for, tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    """The engine's process dies (an out-of-memory kill, a segfault in a kernel): the worker
    reports the crash, gives up its lease and exits 1; another worker finishes the jobs."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=1900) for i in range(3)])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = _worker_cmd(["worker"], tiny_model, keys, pg_url, "--worker-id", "oom")
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING}, 60)
        (engine_pid,) = child_pids(proc.pid)
        os.kill(engine_pid, signal.SIGKILL)
        assert proc.wait(20) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the engine process exited with code -9" in (tmp_path / "worker.log").read_text()
    assert JobQueue(redis_client, MODEL, keys).live_workers() == set()  # lease given up
    survivor = start_worker()
    infos = client.wait(ids, timeout_s=90)
    assert all(i.status is JobStatus.SUCCEEDED and i.attempts == 2 for i in infos), infos
    assert {i.worker_id for i in infos} == {survivor.worker.worker_id}


def test_sigterm_while_the_model_loads_stops_cleanly(
    keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str, wait_for, tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    """A worker told to stop while its engine loads (a rollout, a scale-down) stops once it
    can, holding nothing: exit 0 and its engine process gone, not killed mid-load (-15)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = _worker_cmd(["worker"], tiny_model, keys, pg_url, "--worker-id", "brief")
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        (engine_pid,) = wait_for(lambda: child_pids(proc.pid), 60)  # loading its model
        assert "ready" not in (tmp_path / "worker.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_for(lambda: not _running(engine_pid), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
