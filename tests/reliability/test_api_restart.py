"""The HTTP API server killed (SIGKILL) while its batch is validated and while it runs, then
restarted: the batch completes with every row in its output once, and every job is terminal
with one ``job_metrics`` row (exactly once)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import openai
import sqlalchemy as sa
from api_server import ApiServer
from chaos import MODEL, WorkerProcs, audit
from services import REDIS_URL, jsonl

from jobs import db
from jobs.api.keys import KeyStore
from jobs.constants import Keys

ROWS = 300


def test_api_server_killed_mid_batch_loses_nothing(workers: WorkerProcs, keys: Keys,
                                                   pg_url: str, tmp_path: Path) -> None:
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    services = {"redis_url": REDIS_URL, "database_url": pg_url, "key_prefix": keys.prefix}
    server = ApiServer(services, tmp_path / "files", tmp_path / "api.log", lease_s=2)
    server.start()
    workers.start("w1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KeyStore(engine).create("r")[1],
                           max_retries=0, timeout=30)
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"count to {i}"}]}}
            for i in range(ROWS)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file_id = client.files.create(file=("rows.jsonl", io.BytesIO(data)), purpose="batch").id
    batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id
    server.kill()  # at once: validating (or about to be)
    kills = 1
    server.start()

    deadline = time.monotonic() + 240
    while True:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        if kills == 1 and batch.status == "in_progress" and counts and counts.completed > 20:
            server.kill()  # while the jobs run
            kills += 1
            time.sleep(1.0)
            server.start()
            continue
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    assert kills == 2
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (ROWS, ROWS)
    assert batch.output_file_id is not None
    out = jsonl(client.files.content(batch.output_file_id).text)
    assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)
    assert all(x["response"]["status_code"] == 200 for x in out)
    with engine.connect() as conn:
        job_ids = list(conn.execute(sa.text("SELECT id FROM jobs WHERE batch_id = :b"),
                                    {"b": batch_id}).scalars())
    assert len(job_ids) == ROWS  # no row submitted twice by the resumed validation
    result = audit(engine, job_ids)
    assert (result.lost, result.duplicate_terminal_rows, result.metrics_rows) == (0, 0, ROWS)
    server.stop()
    engine.dispose()
