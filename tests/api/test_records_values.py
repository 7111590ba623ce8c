"""The API's records (``jobs.api.records``) on a real PostgreSQL schema, value by value: ids,
expiry times, owner scoping, the pages' bounds and order, attempt counters, the runner's
unfinished list and the fenced recording of a batch's files."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from jobs.api.keys import KeyStore
from jobs.api.records import ApiRecords, new_id
from jobs.echo import MAX_MESSAGE_CHARS
from jobs.models import ApiBatch, Batch, File
from jobs.schemas import BatchStatus


def _owner(engine: Engine, name: str) -> str:
    return KeyStore(engine).create(name)[0].id


def _file(file_id: str, owner: str, *, purpose: str = "batch", kind: str = "upload",
          batch_id: str | None = None) -> File:
    return File(id=file_id, owner_id=owner, purpose=purpose, filename=f"{file_id}.jsonl",
                bytes=10, kind=kind, batch_id=batch_id)


def _batch(engine: Engine, batch_id: str, owner: str, status: BatchStatus, *,
           files_at: datetime | None = None, fence: int | None = None) -> None:
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        session.add(Batch(id=batch_id, model="tiny", created_at=now, status=status.value,
                          fence=fence, owner=owner))
        session.add(ApiBatch(id=batch_id, owner_id=owner, input_file_id="file-in",
                             endpoint="/v1/chat/completions", completion_window="24h",
                             files_at=files_at))


def _files(engine: Engine) -> dict[str, File]:
    with Session(engine) as session:
        return {f.id: f for f in session.scalars(select(File))}


def test_new_ids_carry_the_time_in_milliseconds_and_random_bits() -> None:
    before = int(time.time() * 1000)
    first = new_id("file-")
    after = int(time.time() * 1000)
    assert first.startswith("file-") and len(first) == len("file-") + 12 + 16
    stamp, rand = first[5:17], first[17:]
    assert before <= int(stamp, 16) <= after
    int(rand, 16)  # hexadecimal
    time.sleep(0.01)
    later = new_id("file-")
    assert later > first  # ids sort by creation time
    assert len({new_id("x") for _ in range(200)}) == 200


def test_add_stamps_the_database_time_and_expiry_inside_the_check(pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    owner = _owner(pg_engine, "a")
    with Session(pg_engine) as session:
        start = session.scalar(select(func.now()))
    row = records.add(_file("file-1", owner), 3600)
    assert row.expires_at - row.created_at == timedelta(seconds=3600)
    assert row.created_at >= start
    stored = _files(pg_engine)["file-1"]
    assert stored.created_at == row.created_at and stored.expires_at == row.expires_at
    seen: list[int] = []

    def refuse(session: Session) -> None:  # a quota check: it sees the rows so far, then says no
        seen.append(len(list(session.scalars(select(File)))))
        raise ValueError("over quota")

    with pytest.raises(ValueError, match="over quota"):
        records.add(_file("file-2", owner), 60, before=refuse)
    assert seen == [1]
    assert set(_files(pg_engine)) == {"file-1"}


def test_expired_files_are_the_past_ones_oldest_first_up_to_the_limit(
        pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    owner = _owner(pg_engine, "a")
    records.add(_file("file-late", owner), -10)
    records.add(_file("file-early", owner), -100)
    records.add(_file("file-mid", owner), -50)
    records.add(_file("file-live", owner), 3600)
    with Session(pg_engine) as session, session.begin():
        forever = _file("file-forever", owner)  # no expiry at all
        forever.created_at = datetime.now(UTC)
        session.add(forever)
    assert [f.id for f in records.expired_files()] == ["file-early", "file-mid", "file-late"]
    assert [f.id for f in records.expired_files(limit=2)] == ["file-early", "file-mid"]


def test_get_and_delete_are_scoped_to_the_owner(pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    records.add(_file("file-a", alice), 60)
    records.add(_file("file-b", bob), 60)
    got = records.get(File, alice, "file-a")
    assert got is not None and got.id == "file-a" and got.owner_id == alice
    assert records.get(File, bob, "file-a") is None
    assert records.get(File, alice, "file-missing") is None
    anyone = records.get(File, None, "file-b")
    assert anyone is not None and anyone.id == "file-b"

    assert records.delete_file(bob, "file-a") is False
    assert set(_files(pg_engine)) == {"file-a", "file-b"}
    assert records.delete_file(alice, "file-a") is True
    assert set(_files(pg_engine)) == {"file-b"}
    assert records.delete_file(alice, "file-a") is False
    assert records.delete_file(None, "file-b") is True
    assert _files(pg_engine) == {}


@pytest.mark.parametrize("newest_first", [True, False])
def test_pages_walk_every_object_once_in_id_order(pg_engine: Engine,
                                                  newest_first: bool) -> None:
    records = ApiRecords(pg_engine)
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    ids = [f"file-{i:02d}" for i in range(7)]
    for i, file_id in enumerate(ids):
        records.add(_file(file_id, alice, purpose="batch" if i % 2 else "fine-tune"), 60)
    records.add(_file("file-99", bob), 60)  # another owner's, in the middle of the range
    records.add(_file("file-03b", bob), 60)
    order = ids[::-1] if newest_first else ids

    pages, after = [], None
    while True:
        rows, more = records.page(File, alice, after=after, limit=3, newest_first=newest_first)
        pages.append(([r.id for r in rows], more))
        if not more:
            break
        after = rows[-1].id
    assert pages == [(order[0:3], True), (order[3:6], True), (order[6:], False)]
    # A page exactly as long as what is left says nothing more follows.
    rows, more = records.page(File, alice, after=None, limit=7, newest_first=newest_first)
    assert [r.id for r in rows] == order and more is False
    rows, more = records.page(File, alice, after=None, limit=6, newest_first=newest_first)
    assert [r.id for r in rows] == order[:6] and more is True
    # After the last id: an empty page.
    assert records.page(File, alice, after=order[-1], limit=3,
                        newest_first=newest_first) == ([], False)
    # Equality filters on columns.
    rows, more = records.page(File, alice, after=None, limit=10, newest_first=newest_first,
                              purpose="batch")
    assert [r.id for r in rows] == [i for i in order if int(i[-2:]) % 2] and more is False


def test_errors_attempts_and_last_error_land_on_their_batch_only(pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    owner = _owner(pg_engine, "a")
    _batch(pg_engine, "batch_1", owner, BatchStatus.VALIDATING)
    _batch(pg_engine, "batch_2", owner, BatchStatus.VALIDATING)
    errors = {"object": "list", "data": [{"code": "invalid_json", "line": 3}]}
    records.set_errors("batch_1", errors)
    assert [records.begin_attempt("batch_1", "validate") for _ in range(3)] == [1, 2, 3]
    assert records.begin_attempt("batch_1", "finalize") == 1
    assert records.begin_attempt("batch_2", "finalize") == 1
    assert records.begin_attempt("batch_missing", "validate") == 0
    records.note_error("batch_2", "x" * (MAX_MESSAGE_CHARS + 100))
    records.note_error("batch_1", "short")
    one = records.get(ApiBatch, owner, "batch_1")
    two = records.get(ApiBatch, owner, "batch_2")
    assert one is not None and two is not None
    assert one.errors == errors and two.errors is None
    assert (one.validate_attempts, one.finalize_attempts) == (3, 1)
    assert (two.validate_attempts, two.finalize_attempts) == (0, 1)
    assert one.last_error == "short"
    assert len(two.last_error or "") == MAX_MESSAGE_CHARS and two.last_error.endswith("…")  # type: ignore[union-attr]


def test_unfinished_is_the_active_and_the_unrecorded_ended_batches_oldest_first(
        pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    owner = _owner(pg_engine, "a")
    done_at = datetime.now(UTC)
    cases = [  # id order is age order
        ("batch_1", BatchStatus.IN_PROGRESS, None, True),
        ("batch_2", BatchStatus.COMPLETED, done_at, False),  # files recorded: done
        ("batch_3", BatchStatus.VALIDATING, None, True),
        ("batch_4", BatchStatus.FAILED, None, False),  # failed: no files to record
        ("batch_5", BatchStatus.COMPLETED, None, True),
        ("batch_6", BatchStatus.CANCELLED, None, True),
        ("batch_7", BatchStatus.EXPIRED, None, True),
        ("batch_8", BatchStatus.EXPIRED, done_at, False),
    ]
    for batch_id, status, files_at, _ in reversed(cases):  # inserted newest first
        _batch(pg_engine, batch_id, owner, status, files_at=files_at)
    assert [b.id for b in records.unfinished()] == [c[0] for c in cases if c[3]]


def test_files_are_recorded_once_and_only_under_the_newest_fence(pg_engine: Engine) -> None:
    records = ApiRecords(pg_engine)
    owner = _owner(pg_engine, "a")
    _batch(pg_engine, "batch_1", owner, BatchStatus.COMPLETED, fence=5)
    _batch(pg_engine, "batch_2", owner, BatchStatus.COMPLETED, fence=5)

    def outputs(tag: str) -> list[File]:
        return [_file(f"file-out-{tag}", owner, purpose="batch_output", kind="output",
                      batch_id="batch_1"),
                _file(f"file-err-{tag}", owner, purpose="batch_output", kind="error",
                      batch_id="batch_1")]

    assert records.record_files("batch_1", outputs("stale"), fence=4, expires_in_s=600) is False
    assert records.record_files("batch_1", outputs("newer"), fence=6, expires_in_s=600) is False
    assert _files(pg_engine) == {}
    row = records.get(ApiBatch, owner, "batch_1")
    assert row is not None and row.files_at is None and row.output_file_id is None

    assert records.record_files("batch_1", outputs("a"), fence=5, expires_in_s=600) is True
    row = records.get(ApiBatch, owner, "batch_1")
    assert row is not None and row.files_at is not None
    assert (row.output_file_id, row.error_file_id) == ("file-out-a", "file-err-a")
    files = _files(pg_engine)
    assert set(files) == {"file-out-a", "file-err-a"}
    for f in files.values():
        assert f.created_at == row.files_at
        assert f.expires_at - f.created_at == timedelta(seconds=600)
    other = records.get(ApiBatch, owner, "batch_2")
    assert other is not None and other.files_at is None and other.output_file_id is None

    # A second try (a retried finalize) changes nothing.
    assert records.record_files("batch_1", outputs("b"), fence=5, expires_in_s=600) is False
    assert set(_files(pg_engine)) == {"file-out-a", "file-err-a"}
    again = records.get(ApiBatch, owner, "batch_1")
    assert again is not None and (again.files_at, again.output_file_id) == (row.files_at,
                                                                            "file-out-a")
    # Only an output file (no line failed): no error file id.
    assert records.record_files("batch_2", [_file("file-out-2", owner, kind="output",
                                                  batch_id="batch_2")],
                                fence=5, expires_in_s=60) is True
    other = records.get(ApiBatch, owner, "batch_2")
    assert other is not None and (other.output_file_id, other.error_file_id) == (
        "file-out-2", None)
