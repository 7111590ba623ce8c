"""API batches always end, whatever their input does: every line that cannot run is that line's
error (mistyped fields, a line nested 10,000 deep), tries at validating a batch or at writing its
files are counted before the work (a try that kills its process counts too) and bounded, and a
batch still validating when its window passes expires."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import BinaryIO

import pytest
from services import wait_until
from sqlalchemy import Engine
from test_batch_runner import _advance_until, _runner, _write_input
from test_openai_api import chat_row, jsonl, lines_of, upload, wait_batch

from jobs.api.batches import Phase
from jobs.api.keys import KeyStore
from jobs.api.objects import openai_status
from jobs.api.storage import DirectoryStorage, _DirectoryUpload
from jobs.models import ApiBatch

DEEP = 10_000


def test_hostile_lines_are_line_errors_and_the_runner_goes_on(openai_client,  # type: ignore[no-untyped-def]
                                                              start_worker) -> None:
    client = openai_client()
    start_worker()
    good = [chat_row(f"good-{i}") for i in range(3)]
    lines = [json.dumps(good[0]),
             json.dumps(chat_row("m5") | {"body": {"model": "tiny", "messages": 5}}),
             json.dumps(chat_row("meta") | {"body": chat_row("meta")["body"] | {
                 "metadata": [1]}}),
             '{"custom_id": "deep", "body": ' + "[" * DEEP + "]" * DEEP + "}",
             json.dumps(chat_row("parts") | {"body": chat_row("parts")["body"] | {  # TypeError
                 "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}}),
             json.dumps(good[1])]
    hostile = client.batches.create(
        input_file_id=upload(client, ("\n".join(lines) + "\n").encode()),
        endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, hostile.id, timeout_s=30)
    assert done.status == "failed" and done.errors is not None
    by_line = {e.line: e for e in done.errors.data or []}
    assert sorted(by_line) == [2, 3, 4, 5]
    assert "messages" in (by_line[2].message or "")
    assert "metadata" in (by_line[3].message or "")
    assert by_line[4].code == "invalid_json_line" and "nested" in (by_line[4].message or "")
    assert (by_line[5].code, by_line[5].message) == ("invalid_request",
                                                     "the request cannot be read (TypeError)")
    # the same runner takes the next batch through
    batch = client.batches.create(input_file_id=upload(client, jsonl(good)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    ran = wait_batch(client, batch.id)
    assert ran.status == "completed" and ran.output_file_id
    assert sorted(x["custom_id"] for x in lines_of(client, ran.output_file_id)) == [
        "good-0", "good-1", "good-2"]


class Died(BaseException):
    """The process doing the work died (nothing after it runs, not even ``except
    Exception``)."""


class FailingStorage(DirectoryStorage):
    """Opening the input file raises ``error``; writing a batch's ``kind`` file does too."""

    def __init__(self, root: Path, error: BaseException | None = None,
                 kind: str | None = None) -> None:
        super().__init__(root)
        self.error, self.kind, self.opened = error, kind, 0

    def open(self, file_id: str) -> BinaryIO:
        if file_id == "file-input" and self.error is not None:
            self.opened += 1
            raise self.error
        return super().open(file_id)

    def begin(self, file_id: str) -> _DirectoryUpload:
        if self.kind is not None and file_id.endswith(f"-{self.kind}"):
            raise OSError(28, "No space left on device")
        return super().begin(file_id)


@pytest.mark.parametrize(("error", "why"), [
    (OSError(5, "Input/output error"), "OSError: [Errno 5] Input/output error"),
    (Died(), "the process doing it stopped"),
])
def test_validation_that_keeps_failing_fails_the_batch_after_its_tries(
        services: dict[str, str], engine: Engine, tmp_path: Path, error: BaseException,
        why: str) -> None:
    owner = KeyStore(engine).create("t")[0].id
    storage = FailingStorage(tmp_path / "files", error)
    runner = _runner(services, storage, max_attempts=3)
    _write_input(runner, owner, 4)
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    for _ in range(3):
        with contextlib.suppress(Died):  # nothing of the runner saw it: only the count
            runner._leased(batch.id, Phase.VALIDATE)
        row = runner.records.get(ApiBatch, owner, batch.id)
        assert row is not None and openai_status(row) == "validating"
    assert storage.opened == 3
    runner._leased(batch.id, Phase.VALIDATE)  # the fourth: no more tries
    assert storage.opened == 3
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and openai_status(row) == "failed"
    assert row.errors["data"] == [{
        "code": "validation_failed", "param": None, "line": None,
        "message": f"the input file could not be validated in 3 tries: {why}"}]
    runner.stop()
    runner.client.close()


def test_a_validating_batch_past_its_window_expires(services: dict[str, str], engine: Engine,
                                                    tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    storage = FailingStorage(tmp_path / "files", OSError(5, "Input/output error"))
    runner = _runner(services, storage)
    _write_input(runner, owner, 2)
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "1h", None)
    runner._leased(batch.id, Phase.VALIDATE)  # a try that fails: still validating
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE batches SET deadline_at = deadline_at - interval '2 hours' "
                             "WHERE id = %(b)s", {"b": batch.id})
    _advance_until(runner, owner, batch.id, "expired")
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and row.files_at is not None  # ended: nothing to write
    assert row.output_file_id is None and row.error_file_id is None
    assert storage.opened == 1  # expired, not tried again
    runner.stop()
    runner.client.close()


def test_files_that_cannot_be_written_end_the_batch_without_them(services: dict[str, str],
                                                                engine: Engine,
                                                                tmp_path: Path) -> None:
    owner = KeyStore(engine).create("t")[0].id
    storage = FailingStorage(tmp_path / "files", kind="error")
    runner = _runner(services, storage, max_attempts=2)
    _write_input(runner, owner, 3)
    batch = runner.create(owner, "file-input", "/v1/chat/completions", "24h", None)
    runner._leased(batch.id, Phase.VALIDATE)
    runner.client.cancel_batch(batch.id)  # every row ends: the batch is finalized next
    for _ in range(5):
        runner.advance(runner.records.get(ApiBatch, owner, batch.id))  # type: ignore[arg-type]
        wait_until(lambda: batch.id not in runner._busy or None, 10, 0.05)
    row = runner.records.get(ApiBatch, owner, batch.id)
    assert row is not None and openai_status(row) == "cancelled"
    assert row.finalize_attempts == 3 and row.files_at is not None
    assert row.output_file_id is None and row.error_file_id is None
    assert row.errors["data"][0]["code"] == "output_failed"
    assert row.errors["data"][0]["message"] == (
        "the output files could not be written in 2 tries: "
        "OSError: [Errno 28] No space left on device")
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["file-input"]
    runner.stop()
    runner.client.close()
