"""The batch runner without the HTTP layer: a validation pass cut off midway (the process
died) is finished by the next process once the lease runs out, without submitting a row
twice; a live lease keeps a second process away."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from services import wait_until
from sqlalchemy import Engine

from jobs.api.batches import CHUNK_ROWS, BatchRunner, Status
from jobs.api.keys import KeyStore
from jobs.api.records import ApiRecords
from jobs.api.settings import ApiSettings
from jobs.api.storage import DirectoryStorage
from jobs.client import JobClient
from jobs.models import ApiBatch, File

ROWS = 2 * CHUNK_ROWS + 500


class Crash(Exception):
    pass


class DyingStorage(DirectoryStorage):
    """The second read of a file (the submitting pass) dies after ``lines`` lines."""

    def __init__(self, root: Path, lines: int) -> None:
        super().__init__(root)
        self.lines, self.reads = lines, 0

    def open(self, file_id: str) -> BinaryIO:
        self.reads += 1
        f = super().open(file_id)
        return _Dying(f, self.lines) if self.reads == 2 else f


class _Dying:
    def __init__(self, f: BinaryIO, lines: int) -> None:
        self.f, self.lines = f, lines

    def __enter__(self) -> _Dying:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def __iter__(self) -> Iterator[bytes]:
        for n, line in enumerate(self.f):
            if n == self.lines:
                raise Crash("the process died")
            yield line


def _runner(services: dict[str, str], storage: DirectoryStorage) -> BatchRunner:
    client = JobClient(database=services["database_url"], redis_url=services["redis_url"],
                       key_prefix=services["key_prefix"])
    settings = ApiSettings(models=["tiny"], lease_s=0.5, files_dir=storage.root)
    return BatchRunner(client, ApiRecords(client.engine), storage, settings)


def test_validation_cut_off_is_resumed_without_duplicates(services: dict[str, str],
                                                          engine: Engine,
                                                          tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    dying = DyingStorage(tmp_path / "files", lines=CHUNK_ROWS + 700)
    first = _runner(services, dying)
    upload = dying.begin("file-input")
    for i in range(ROWS):
        upload.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": {"model": "tiny", "max_tokens": 2, "messages": [
                                     {"role": "user", "content": f"q{i}"}]}}).encode() + b"\n")
    upload.commit()
    first.records.add(File(id="file-input", owner_id=owner, purpose="batch", filename="in.jsonl",
                           bytes=0, kind="upload"))
    batch = first.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    assert first.records.claim(batch.id, Status.VALIDATING, 0.5)
    with pytest.raises(Crash):
        first._validate(batch.id)
    stored = {cid: job_id for job_id, cid, _ in first.client.batch_jobs(batch.id)}
    assert len(stored) == CHUNK_ROWS  # one chunk made it before the crash

    second = _runner(services, DirectoryStorage(tmp_path / "files"))
    assert not second.records.claim(batch.id, Status.VALIDATING, 0.5)  # the lease holds
    row = wait_until(lambda: second.records.get(ApiBatch, owner, batch.id), 5)
    wait_until(lambda: second.advance(row) or second.records.get(
        ApiBatch, owner, batch.id).status == Status.IN_PROGRESS, 10, 0.2,  # type: ignore[union-attr]
        what="the batch in progress")
    jobs = {cid: job_id for job_id, cid, _ in second.client.batch_jobs(batch.id)}
    assert len(jobs) == ROWS
    assert all(jobs[cid] == job_id for cid, job_id in stored.items())  # kept, not redone
    done = second.records.get(ApiBatch, owner, batch.id)
    assert done is not None and done.total == ROWS and done.model == "tiny"
    for runner in (first, second):
        runner.stop()
        runner.client.close()
