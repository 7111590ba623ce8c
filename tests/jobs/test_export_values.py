"""``jobs.export.export_batch`` value by value, with no model: a batch's jobs settled by hand,
exported into a list. Checked: the bytes (one UTF-8 line each, in id order), the size it
returns, the ``succeeded`` filter, and a stop asked for by ``going`` (mid-way and at the end)."""

from __future__ import annotations

import time

import pytest
import redis
import sqlalchemy as sa

import jobs.export
from jobs.client import JobClient
from jobs.constants import Keys
from jobs.export import export_batch
from jobs.schemas import JobInfo, JobResult, JobSpec, JobStatus, Outcome
from jobs.store import DeliveryStore, JobReader

MODEL = "tiny"


def _batch(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> list[str]:
    """Five jobs of batch ``ex``: c0, c2, c4 succeeded, c1 failed, c3 cancelled."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    specs = [JobSpec(model=MODEL, prompt=f"p{i}", batch_id="ex", custom_id=f"c{i}")
             for i in range(5)]
    client.submit(specs)
    ids = [s.id for s in specs]
    store = DeliveryStore(pg_engine)
    store.begin_deliveries(ids, "w", 3, time.time())
    status = [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.SUCCEEDED, JobStatus.CANCELLED,
              JobStatus.SUCCEEDED]
    store.finish([Outcome(j, s, time.time(), error=None if s is JobStatus.SUCCEEDED else "no",
                          result=JobResult(text=f"héllo ✓ {i}")
                          if s is JobStatus.SUCCEEDED else None)
                  for i, (j, s) in enumerate(zip(ids, status, strict=True))])
    return ids


def _line(info: JobInfo) -> str:
    return f"{info.custom_id} {info.status.value} {info.result.text if info.result else '-'}"


def test_lines_bytes_size_and_filters(redis_client: redis.Redis, keys: Keys,
                                      pg_engine: sa.Engine) -> None:
    ids = _batch(redis_client, keys, pg_engine)
    by_id = sorted(range(5), key=lambda i: ids[i])  # the export's order: job id
    reader = JobReader(pg_engine)
    lines = {0: "c0 succeeded héllo ✓ 0", 1: "c1 failed -", 2: "c2 succeeded héllo ✓ 2",
             3: "c3 cancelled -", 4: "c4 succeeded héllo ✓ 4"}
    for succeeded, wanted in ((None, range(5)), (True, (0, 2, 4)), (False, (1, 3))):
        written: list[bytes] = []
        size = export_batch(reader, "ex", written.append, _line, succeeded=succeeded)
        expected = [(lines[i] + "\n").encode() for i in by_id if i in wanted]
        assert written == expected
        assert size == sum(len(b) for b in expected)
    assert export_batch(reader, "no-such-batch", [].append, _line) == 0


def test_going_stops_the_export(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    _batch(redis_client, keys, pg_engine)
    reader = JobReader(pg_engine)
    asked: list[int] = []

    def lost() -> bool:
        asked.append(1)
        return False

    # Asked after every line: the first answer stops it.
    monkeypatch.setattr(jobs.export, "CHECK_EVERY_S", 0.0)
    written: list[bytes] = []
    assert export_batch(reader, "ex", written.append, _line, going=lost) is None
    assert len(written) == 1 and len(asked) == 1
    # Not asked while writing (an hour between questions): asked once, at the end.
    monkeypatch.setattr(jobs.export, "CHECK_EVERY_S", 3600.0)
    written.clear()
    asked.clear()
    assert export_batch(reader, "ex", written.append, _line, going=lost) is None
    assert len(written) == 5 and len(asked) == 1
    asked.clear()
    # Asked every 5 ms, each line taking 20 ms to write: asked after the first line.
    monkeypatch.setattr(jobs.export, "CHECK_EVERY_S", 0.005)
    written.clear()

    def slow(data: bytes) -> None:
        written.append(data)
        time.sleep(0.02)

    assert export_batch(reader, "ex", slow, _line, going=lost) is None
    assert len(written) == 1 and len(asked) == 1
    asked.clear()

    def kept() -> bool:
        asked.append(1)
        return True

    monkeypatch.setattr(jobs.export, "CHECK_EVERY_S", 0.0)
    assert export_batch(reader, "ex", [].append, _line, going=kept) is not None
    assert len(asked) == 6  # after each of the 5 lines, and at the end
