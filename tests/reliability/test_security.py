"""Security: no pickle/eval/exec on input paths, size limits, bound SQL parameters, no
credentials in logs or metrics, TLS URLs accepted, no prompt text in metrics."""

from __future__ import annotations

import ast
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from chaos import MODEL, REPO, RedisServer, free_port
from services import all_roles_store

from jobs.client import JobClient
from jobs.constants import FIELD_ID, FIELD_JOB, MAX_PAYLOAD_BYTES, Keys
from jobs.schemas import JobSpec

SQL = all_roles_store()

FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}


def _sources() -> list[Path]:
    return sorted(p for d in ("jobs", "worker") for p in (REPO / d).rglob("*.py"))


def test_no_pickle_eval_or_exec_in_the_service() -> None:
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in FORBIDDEN_MODULES for n in names):
                    offenders.append(f"{path}:{node.lineno} imports {names}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in FORBIDDEN_CALLS:
                offenders.append(f"{path}:{node.lineno} calls {node.func.id}")
    assert offenders == []
    from worker.control.app import make_app

    conf = make_app().conf  # Celery: JSON only, pickle never accepted
    assert conf.task_serializer == conf.result_serializer == "json"
    assert set(conf.accept_content) == {"json"}


# A protocol-0 pickle that runs `touch` when unpickled (written out: no pickle module here).
PICKLE_PAYLOAD = b"cposix\nsystem\n(S'touch /tmp/kvbatch-pickle-was-loaded'\ntR."


def test_pickle_payload_is_rejected(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                                    workers) -> None:  # type: ignore[no-untyped-def]
    marker = Path("/tmp/kvbatch-pickle-was-loaded")
    marker.unlink(missing_ok=True)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    spec = JobSpec(model=MODEL, prompt="p")
    SQL(client.engine).insert_jobs([spec])
    raw = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    raw.xadd(keys.stream(MODEL, 0), {FIELD_ID: spec.id, FIELD_JOB: PICKLE_PAYLOAD})
    raw.close()
    worker = workers.start("pickled")
    (info,) = client.wait([spec.id], timeout_s=60)
    assert info.status.value == "failed" and "malformed job message" in info.error
    assert not marker.exists() and worker.alive()


def test_size_limits_and_bound_parameters(redis_client: redis.Redis, keys: Keys,
                                          pg_engine: sa.Engine) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    with pytest.raises(ValueError, match="byte limit"):
        client.submit([JobSpec(model=MODEL, prompt="é" * (MAX_PAYLOAD_BYTES // 2 + 1))])
    assert SQL(client.engine).count_by_status() == {}  # nothing stored
    hostile = "'); DROP TABLE jobs; --"
    spec = JobSpec(model=MODEL, prompt=hostile, custom_id=hostile, batch_id="b-1",
                   metadata={hostile: hostile})
    client.submit([spec])
    info = client.get(spec.id)
    assert info.custom_id == hostile and info.metadata == {hostile: hostile}
    assert SQL(client.engine).specs([spec.id])[0][0].prompt == hostile
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 1


def test_credentials_never_in_logs_or_metrics(keys: Keys, pg_url: str, pg_engine: sa.Engine,
                                              tiny_model: str, tmp_path: Path) -> None:
    from chaos import WorkerProcs

    server = RedisServer(tmp_path / "redis", password="r3dis-s3cret")
    server.start()
    # Trust auth accepts any password: the worker still carries it in its URL.
    pg_secret_url = pg_url.replace("postgres@", "postgres:pg-s3cret@", 1)
    assert "pg-s3cret" in pg_secret_url
    port = free_port(9400)
    procs = WorkerProcs(tiny_model, keys, server.url, pg_secret_url, tmp_path / "logs")
    try:
        worker = procs.start("secretive", metrics_port=port)
        rc = redis.Redis.from_url(server.url, decode_responses=True)
        client = JobClient(rc, pg_engine, key_prefix=keys.prefix)
        (job_id,) = client.submit([JobSpec(model=MODEL, prompt="SECRET-PROMPT-4711",
                                           sampling={"max_tokens": 4})])
        assert client.wait([job_id], timeout_s=60)[0].status.value == "succeeded"
        server.stop()  # Redis goes away: the worker logs connection errors
        time.sleep(3.0)
        server.start()
        time.sleep(2.0)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        worker.proc.terminate()
        worker.proc.wait(30)
        log = worker.log()
        assert "redis unavailable" in log or "heartbeat failed" in log, log[-2000:]
        for secret in ("r3dis-s3cret", "pg-s3cret"):
            assert secret not in log and secret not in metrics
        assert "SECRET-PROMPT-4711" not in metrics and job_id not in metrics
        rc.close()
    finally:
        procs.kill_all()
        server.stop()


def test_tls_urls_are_accepted(keys: Keys) -> None:
    from worker.loop import Worker
    from worker.settings import worker_settings

    settings = worker_settings(
        model="tiny", redis_url="rediss://:pw@redis.example:6380/0?ssl_cert_reqs=required",
        database_url="postgresql://u:pw@db.example:5432/kv?sslmode=verify-full",
        key_prefix=keys.prefix)
    w = Worker(settings, llm=None)  # builds clients; connects to nothing yet
    assert w.redis.connection_pool.connection_class is redis.SSLConnection
    assert w.db.url.query["sslmode"] == "verify-full"
    assert w.db.url.drivername == "postgresql+psycopg"
    assert "pw" not in repr(w.db.url)
