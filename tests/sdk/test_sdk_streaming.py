"""``Client.submit_batch`` streams its rows: an iterable is read, checked and stored a chunk
at a time, so the producer's memory does not grow with the batch (ids aside)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from jobs import Client
from jobs.rows import Row
from jobs.schemas import JobSpec, JobStatus


class CountingRows:
    """``n`` plain rows, made as they are read; ``read`` says how many were."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            self.read += 1
            yield {"prompt": "hi", "max_tokens": 2, "metadata": {"i": i}}  # custom_id: i


def test_a_generator_is_stored_a_chunk_at_a_time(client: Client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    rows = CountingRows(2500)
    read_at_store: list[int] = []
    insert = client.jobs.producer.insert_jobs

    def counting_insert(specs: Sequence[JobSpec], **kwargs: Any) -> None:
        read_at_store.append(rows.read)
        insert(specs, **kwargs)

    monkeypatch.setattr(client.jobs.producer, "insert_jobs", counting_insert)
    batch = client.submit_batch(rows, batch_id="streamed", chunk_size=1000)
    # The first chunk is stored while at most the next one is read (store behind).
    assert len(read_at_store) == 3
    assert read_at_store[0] <= 2000
    assert rows.read == 2500
    assert sorted(batch.submitted, key=int) == [str(i) for i in range(2500)]
    assert client.jobs.count_by_status(batch_id="streamed") == {JobStatus.QUEUED: 2500}
    # Indices run on across chunks: row 1700 is custom_id "1700".
    info = client.jobs.get(batch.submitted["1700"])
    assert info is not None and info.custom_id == "1700" and info.metadata == {"i": 1700}


def test_a_custom_id_repeated_in_a_later_chunk_is_refused(client: Client) -> None:
    rows = ({"custom_id": cid, "prompt": "hi"} for cid in ["a", "b", "c", "a"])
    with pytest.raises(ValueError, match="custom_id 'a' appears more than once"):
        client.submit_batch(rows, batch_id="twice", chunk_size=2)
    # The chunk before the repeat was stored: submitting the fixed rows resumes the batch.
    batch = client.submit_batch([{"custom_id": c, "prompt": "hi"} for c in "abcd"],
                                batch_id="twice", chunk_size=2)
    assert sorted(batch.job_ids) == ["a", "b", "c", "d"]
    assert sum(client.jobs.count_by_status(batch_id="twice").values()) == 4


def test_a_refused_row_repeated_in_a_later_chunk_is_refused_too(client: Client) -> None:
    rows = iter([{"custom_id": "a", "prompt": "hi", "temperature": -1.0},
                 {"custom_id": "b", "prompt": "hi"}, {"custom_id": "a", "prompt": "hi"}])
    rejected: dict[str, Row] = {}
    with pytest.raises(ValueError, match="custom_id 'a' appears more than once"):
        client.submit_batch(rows, batch_id="refused-twice", chunk_size=2,
                            rejected=rejected)
    assert list(rejected) == ["a"]
    assert client.jobs.count_by_status(batch_id="refused-twice") == {JobStatus.QUEUED: 1}


def _transient_peak_bytes(client: Client, n: int) -> int:
    """Peak traced bytes of submitting ``n`` rows beyond what the call keeps (its handle's
    id mappings), the storing stubbed out: what the SDK buffers."""
    tracemalloc.start()
    try:
        batch = client.submit_batch(CountingRows(n), batch_id=f"mem-{n}", chunk_size=500)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(batch.submitted) == n
    return peak - kept


def test_buffered_memory_does_not_grow_with_the_batch(client: Client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(client.jobs, "submit_batch", lambda batch_id, specs, *a, **k: {
        str(s.custom_id): s.id for s in specs})
    monkeypatch.setattr(client.jobs, "batch_settings", lambda batch_id: None)
    small, large = (_transient_peak_bytes(client, n) for n in (2_000, 20_000))
    # Materialized, ten times the rows would buffer ten times the bytes.
    assert large < 2 * small, (small, large)
