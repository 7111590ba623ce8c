"""The per-key quotas (``jobs.api.quotas``) on a real PostgreSQL schema, value by value: which
batches count as active (not ended, or ended and not finalized, never a failed one), which
requests count as queued, that one key's rows never count against another's, that a new batch
is refused at the request limit, and that each check holds the key's row locked until its
transaction ends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from jobs.api.keys import KeyStore
from jobs.api.objects import ApiError
from jobs.api.quotas import Quotas
from jobs.api.settings import ApiSettings
from jobs.models import ApiBatch, Batch, File, Job
from jobs.schemas import BatchStatus, JobStatus


def _owner(engine: Engine, name: str) -> str:
    return KeyStore(engine).create(name)[0].id


def _batch(engine: Engine, batch_id: str, owner: str, status: BatchStatus, *,
           finalized: bool = False, jobs: dict[JobStatus, int] | None = None) -> None:
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        session.add(Batch(id=batch_id, model="tiny", created_at=now, status=status.value,
                          owner=owner))
        session.add(ApiBatch(id=batch_id, owner_id=owner, input_file_id="file-in",
                             endpoint="/v1/chat/completions", completion_window="24h",
                             files_at=now if finalized else None))
        session.flush()
        for job_status, n in (jobs or {}).items():
            for i in range(n):
                session.add(Job(id=f"{batch_id}-{job_status.value}-{i}", batch_id=batch_id,
                                model="tiny", status=job_status.value, spec={},
                                created_at=now))


def _quotas(**settings: int) -> Quotas:
    return Quotas(ApiSettings(**settings))  # type: ignore[arg-type]


def _check(engine: Engine, call, *args: object) -> ApiError | None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, session.begin():
        try:
            call(session, *args)
        except ApiError as exc:
            return exc
    return None


def test_active_batches_count_unended_and_unfinalized_but_not_failed(pg_engine: Engine) -> None:
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    _batch(pg_engine, "b-validating", alice, BatchStatus.VALIDATING)
    _batch(pg_engine, "b-running", alice, BatchStatus.IN_PROGRESS)
    _batch(pg_engine, "b-cancelled", alice, BatchStatus.CANCELLED)  # ended, not finalized
    _batch(pg_engine, "b-done", alice, BatchStatus.COMPLETED, finalized=True)
    _batch(pg_engine, "b-failed", alice, BatchStatus.FAILED)  # never finalized, never counts
    # alice has exactly three: a fourth is refused at a limit of three, allowed at four
    refused = _check(pg_engine, _quotas(max_active_batches_per_key=3).check_batch, alice)
    assert refused is not None and refused.status == 400 and refused.code == "quota_exceeded"
    assert refused.message == ("quota exceeded: the key has 3 batches that have not ended, and "
                               "a key may have at most 3 "
                               "(KVBATCH_API_MAX_ACTIVE_BATCHES_PER_KEY)")
    assert _check(pg_engine, _quotas(max_active_batches_per_key=4).check_batch, alice) is None
    # bob's count is his own: alice's three batches do not refuse his first at a limit of one
    assert _check(pg_engine, _quotas(max_active_batches_per_key=1).check_batch, bob) is None
    _batch(pg_engine, "b-bob", bob, BatchStatus.IN_PROGRESS)
    refused = _check(pg_engine, _quotas(max_active_batches_per_key=1).check_batch, bob)
    assert refused is not None and "the key has 1 batches" in refused.message


def test_queued_rows_count_queued_and_running_of_the_keys_own_batches(pg_engine: Engine) -> None:
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    _batch(pg_engine, "b-a1", alice, BatchStatus.IN_PROGRESS,
           jobs={JobStatus.QUEUED: 2, JobStatus.RUNNING: 3, JobStatus.SUCCEEDED: 4,
                 JobStatus.FAILED: 1, JobStatus.CANCELLED: 1, JobStatus.EXPIRED: 1})
    _batch(pg_engine, "b-a2", alice, BatchStatus.IN_PROGRESS, jobs={JobStatus.RUNNING: 1})
    _batch(pg_engine, "b-b1", bob, BatchStatus.IN_PROGRESS, jobs={JobStatus.QUEUED: 7})
    with Session(pg_engine) as session:
        assert Quotas.queued_rows(session, alice) == 6
        assert Quotas.queued_rows(session, bob) == 7
        assert Quotas.queued_rows(session, _owner(pg_engine, "carol")) == 0
    # alice's six plus four is ten: allowed at ten, refused at nine with both numbers named
    assert _check(pg_engine, _quotas(max_queued_rows_per_key=10).check_rows, alice, 4) is None
    refused = _check(pg_engine, _quotas(max_queued_rows_per_key=9).check_rows, alice, 4)
    assert refused is not None and refused.message == (
        "quota exceeded: the key has 6 requests queued or running and this batch 4, and a key "
        "may have at most 9 (KVBATCH_API_MAX_QUEUED_ROWS_PER_KEY)")
    # bob's seven do not count against carol, nor alice's against bob
    assert _check(pg_engine, _quotas(max_queued_rows_per_key=8).check_rows, bob, 1) is None


def test_a_new_batch_is_refused_at_the_request_limit(pg_engine: Engine) -> None:
    owner = _owner(pg_engine, "team")
    _batch(pg_engine, "b-1", owner, BatchStatus.IN_PROGRESS, jobs={JobStatus.QUEUED: 5})
    quotas = _quotas(max_active_batches_per_key=10, max_queued_rows_per_key=5)
    refused = _check(pg_engine, quotas.check_batch, owner)  # one active of ten: rows refuse it
    assert refused is not None and refused.message == (
        "quota exceeded: the key has 5 requests queued or running, and a key may have at most "
        "5 (KVBATCH_API_MAX_QUEUED_ROWS_PER_KEY)")
    quotas = _quotas(max_active_batches_per_key=10, max_queued_rows_per_key=6)
    assert _check(pg_engine, quotas.check_batch, owner) is None


def test_upload_counts_only_the_keys_own_files(pg_engine: Engine) -> None:
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    with Session(pg_engine) as session, session.begin():
        for i, size in enumerate((300, 500)):
            session.add(File(id=f"file-{i}", owner_id=alice, purpose="batch", filename="f",
                             bytes=size, kind="upload", created_at=datetime.now(UTC)))
    quotas = _quotas(max_files_per_key=3, max_stored_bytes_per_key=1000)
    assert _check(pg_engine, quotas.check_upload, alice, 200) is None  # 800 + 200 = 1000
    refused = _check(pg_engine, quotas.check_upload, alice, 201)
    assert refused is not None and refused.message == (
        "quota exceeded: the key's files hold 800 bytes and this one 201, and a key may have at "
        "most 1000 (KVBATCH_API_MAX_STORED_BYTES_PER_KEY)")
    refused = _check(pg_engine, _quotas(max_files_per_key=2).check_upload, alice, 1)
    assert refused is not None and "the key holds 2 files" in refused.message
    assert _check(pg_engine, _quotas(max_files_per_key=1).check_upload, bob, 1000) is None


@pytest.mark.parametrize("check", ["upload", "batch"])
def test_each_check_locks_the_keys_row_until_its_transaction_ends(pg_engine: Engine,
                                                                  check: str) -> None:
    alice, bob = _owner(pg_engine, "alice"), _owner(pg_engine, "bob")
    quotas = _quotas()

    def try_lock(owner: str) -> bool:
        with pg_engine.connect() as conn:
            try:
                conn.execute(text("SELECT id FROM api_keys WHERE id = :id FOR UPDATE NOWAIT"),
                             {"id": owner})
            except OperationalError as exc:
                assert "could not obtain lock" in str(exc)
                return False
            finally:
                conn.rollback()
        return True

    with Session(pg_engine) as session, session.begin():
        if check == "upload":
            quotas.check_upload(session, alice, 1)
        else:
            quotas.check_batch(session, alice)
        assert not try_lock(alice)  # a second request of alice's waits for this one
        assert try_lock(bob)  # another key's does not
    assert try_lock(alice)
