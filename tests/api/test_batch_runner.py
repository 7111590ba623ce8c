"""The batch runner without the HTTP layer: a validation pass cut off midway (the process
died) is finished by the next process once the lease runs out, without submitting a row
twice; a live lease keeps a second process away, and the first holder's writes are refused once
the second took over (fencing); a batch cancelled while its rows are being
stored ends with every stored row cancelled; an over-long line is an error of its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
from services import jsonl, wait_until
from sqlalchemy import Engine

from jobs.api.batches import CHUNK_ROWS, BatchRunner, Phase
from jobs.api.keys import KeyStore
from jobs.api.objects import openai_status
from jobs.api.records import ApiRecords
from jobs.api.settings import ApiSettings
from jobs.api.storage import DirectoryStorage
from jobs.client import JobClient
from jobs.lease import LeaseLost
from jobs.models import ApiBatch, File

ROWS = 2 * CHUNK_ROWS + 500


class Crash(Exception):
    pass


class HookStorage(DirectoryStorage):
    """The second read of a file (the submitting pass) calls ``hook`` at line ``lines``."""

    def __init__(self, root: Path, lines: int, hook: Callable[[], None]) -> None:
        super().__init__(root)
        self.lines, self.hook, self.reads = lines, hook, 0

    def open(self, file_id: str) -> BinaryIO:
        self.reads += 1
        f = super().open(file_id)
        return _Hooked(f, self.lines, self.hook) if self.reads == 2 else f  # type: ignore[return-value]


class _Hooked:
    def __init__(self, f: BinaryIO, lines: int, hook: Callable[[], None]) -> None:
        self.f, self.lines, self.hook, self.n = f, lines, hook, 0

    def __enter__(self) -> _Hooked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def readline(self, size: int = -1) -> bytes:
        if self.n == self.lines:
            self.hook()
        self.n += 1
        return self.f.readline(size)


def _die() -> None:
    raise Crash("the process died")


def _advance_until(runner: BatchRunner, owner: str, batch_id: str, status: str) -> None:
    """Advance the batch (as the runner's loop does) until OpenAI's view of it is ``status``."""
    def reached() -> bool:
        row = runner.records.get(ApiBatch, owner, batch_id)
        assert row is not None
        runner.advance(row)
        return openai_status(runner.records.get(ApiBatch, owner, batch_id)) == status  # type: ignore[arg-type]

    wait_until(reached, 10, 0.2, what=f"the batch {status}")


def _write_input(runner: BatchRunner, owner: str, rows: int, extra: bytes = b"") -> None:
    upload = runner.storage.begin("file-input")
    for i in range(rows):
        upload.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"model": "tiny", "max_tokens": 2, "messages": [
                                     {"role": "user", "content": f"q{i}"}]}}).encode() + b"\n")
    upload.write(extra)
    upload.commit()
    runner.records.add(File(id="file-input", owner_id=owner, purpose="batch",
                            filename="in.jsonl", bytes=0, kind="upload"), 3600)


def _runner(services: dict[str, str], storage: DirectoryStorage,
            **settings_: object) -> BatchRunner:
    client = JobClient(database=services["database_url"], redis_url=services["redis_url"],
                       key_prefix=services["key_prefix"])
    # a lease long enough for a loaded machine to read 1,000 lines between two renewals
    settings = ApiSettings(**{"lease_s": 3.0, "files_dir": storage.root, **settings_})  # type: ignore[arg-type]
    return BatchRunner(client, ApiRecords(client.engine), storage, settings, ["tiny"])


def test_validation_cut_off_is_resumed_without_duplicates(services: dict[str, str],
                                                          engine: Engine,
                                                          tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    first = _runner(services, HookStorage(tmp_path / "files", CHUNK_ROWS + 700, _die))
    _write_input(first, owner, ROWS)
    batch = first.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    lease = first.lease(batch.id)
    assert lease.acquire() and lease.token is not None
    assert first.batches.fence(batch.id, lease.token)
    with pytest.raises(Crash):
        first._validate(batch, lease)
    stored = {cid: job_id for job_id, cid, _ in first.client.batch_jobs(batch.id)}
    assert len(stored) == CHUNK_ROWS  # one chunk made it before the crash

    second = _runner(services, DirectoryStorage(tmp_path / "files"))
    assert not second.lease(batch.id).acquire()
    row = wait_until(lambda: second.records.get(ApiBatch, owner, batch.id), 5)
    wait_until(lambda: second.advance(row) or openai_status(second.records.get(  # type: ignore[arg-type]
        ApiBatch, owner, batch.id)) == "in_progress", 10, 0.2, what="the batch in progress")
    jobs = {cid: job_id for job_id, cid, _ in second.client.batch_jobs(batch.id)}
    assert len(jobs) == ROWS
    assert all(jobs[cid] == job_id for cid, job_id in stored.items())  # kept, not redone
    done = second.records.get(ApiBatch, owner, batch.id)
    assert done is not None and done.batch.num_jobs == ROWS and done.batch.model == "tiny"
    # the first holder, back from its stall, stores nothing more
    late = next(spec for _, spec in first._specs(done, None))
    with pytest.raises(LeaseLost):
        first.client.store([late.model_copy(update={"custom_id": "late"})],
                           fence=lease.token)
    assert len(second.client.batch_jobs(batch.id)) == ROWS
    for runner in (first, second):
        runner.stop()
        runner.client.close()


def test_cancel_while_rows_are_stored_leaves_none_to_run(services: dict[str, str],
                                                        engine: Engine, tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    holder: list[BatchRunner] = []
    batch_ids: list[str] = []
    runner = _runner(services, HookStorage(tmp_path / "files", CHUNK_ROWS + 500,
                                           lambda: holder[0].cancel(owner, batch_ids[0])))
    holder.append(runner)
    _write_input(runner, owner, ROWS)
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    batch_ids.append(batch.id)
    runner._leased(batch.id, Phase.VALIDATE)  # cancelled at line 1,500
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and openai_status(row) == "cancelling"
    # the chunk that was being read when the cancel came was stored after it: it is cancelled
    # too before the batch ends
    _advance_until(runner, owner, batch.id, "cancelled")
    jobs = runner.client.batch_jobs(batch.id)
    assert len(jobs) == 2 * CHUNK_ROWS
    assert {status.value for _, _, status in jobs} == {"cancelled"}
    runner.stop()
    runner.client.close()


def test_a_line_over_the_request_limit_is_reported_not_read_whole(services: dict[str, str],
                                                                 engine: Engine,
                                                                 tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    runner = _runner(services, DirectoryStorage(tmp_path / "files"))
    _write_input(runner, owner, 3, extra=b'{"custom_id": "' + b"x" * (2 << 20) + b'"}\n'
                 + b'{"custom_id": "r0"}\n')
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    runner._leased(batch.id, Phase.VALIDATE)
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and openai_status(row) == "failed"
    errors = {e["line"]: e for e in row.errors["data"]}
    assert sorted(errors) == [4, 5]
    assert "byte limit" in errors[4]["message"] and errors[5]["param"] == "url"
    assert runner.client.batch_jobs(batch.id) == []
    runner.stop()
    runner.client.close()


def test_a_batch_past_its_window_ends_expired_with_an_error_file(services: dict[str, str],
                                                                  engine: Engine,
                                                                  tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    runner = _runner(services, DirectoryStorage(tmp_path / "files"))
    _write_input(runner, owner, 4)
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "1h", None)
    runner._leased(batch.id, Phase.VALIDATE)
    with engine.begin() as conn:  # an hour later, no worker having run anything
        for table, column in (("batches", "deadline_at"), ("jobs", "deadline_at")):
            key = "batch_id" if table == "jobs" else "id"
            conn.exec_driver_sql(f"UPDATE {table} SET {column} = {column} - interval '2 hours' "
                                 f"WHERE {key} = %(b)s", {"b": batch.id})
    _advance_until(runner, owner, batch.id, "expired")
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and row.files_at is not None and row.output_file_id is None
    assert row.error_file_id is not None
    lines = jsonl(runner.storage.open(row.error_file_id).read().decode())
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2", "r3"]
    assert {x["error"]["code"] for x in lines} == {"batch_expired"}
    runner.stop()
    runner.client.close()
