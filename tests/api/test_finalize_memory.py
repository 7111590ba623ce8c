"""Finalizing a batch holds one fetch of results, not the batch: the output file of 2,000 rows of
large results (logprobs on every token) is written with the same peak memory as that of 200
(tracemalloc, within a small factor), and its lines are every succeeded row's, in job order,
with its text and logprobs."""

from __future__ import annotations

import json
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Engine, insert

from jobs.export import FETCH_ROWS, export_batch
from jobs.models import Batch, Job
from jobs.rows import RowKind, output_line
from jobs.store import JobReader

TOKENS = 100  # per result, each with its logprob entry and two top alternatives


def _batch(engine: Engine, batch_id: str, rows: int) -> None:
    now = datetime.now(UTC)
    logprobs = [{"token": f"t{i}", "token_id": i, "logprob": -0.5, "bytes": [116],
                 "top_logprobs": [{"token": "a", "token_id": 1, "logprob": -1.0, "bytes": [97]},
                                  {"token": "b", "token_id": 2, "logprob": -2.0,
                                   "bytes": [98]}]} for i in range(TOKENS)]
    with engine.begin() as conn:
        conn.execute(insert(Batch).values(id=batch_id, model="tiny", metadata={},
                                          created_at=now, num_jobs=rows, status="completed"))
        for start in range(0, rows, 200):
            conn.execute(insert(Job), [{
                "id": f"{batch_id}-{i:06d}", "batch_id": batch_id, "custom_id": f"r{i}",
                "model": "tiny", "status": "succeeded" if i % 10 else "failed", "priority": 0,
                "spec": {}, "metadata": {}, "created_at": now, "attempts": 1,
                "cancel_requested": False, "text": f"answer {i} " + "word " * TOKENS,
                "token_ids": list(range(TOKENS)), "finish_reason": "length",
                "logprobs": logprobs, "error": None if i % 10 else "boom",
            } for i in range(start, min(start + 200, rows))])


def _finalize_peak(engine: Engine, batch_id: str, out: Path) -> tuple[int, int]:
    reader = JobReader(engine)
    with out.open("wb") as f:
        tracemalloc.start()
        try:
            size = export_batch(reader, batch_id, f.write, lambda info: json.dumps(
                output_line(RowKind.COMPLETION, info)), succeeded=True)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert size == out.stat().st_size
    return peak, size


def test_finalizing_memory_does_not_grow_with_the_batch(pg_engine: Engine,
                                                        tmp_path: Path) -> None:
    _batch(pg_engine, "small", 200)
    _batch(pg_engine, "large", 2000)
    small_peak, small_size = _finalize_peak(pg_engine, "small", tmp_path / "small.jsonl")
    large_peak, large_size = _finalize_peak(pg_engine, "large", tmp_path / "large.jsonl")
    assert large_size > 9 * small_size  # ten times the rows, about ten times the bytes
    assert large_peak < 1.5 * small_peak, (small_peak, large_peak)
    # one fetch of rows as Python objects (about 25 KiB of them per logprob-KiB of JSON) and
    # one line: a page of 500 such rows would be about 250 MiB
    assert large_peak < FETCH_ROWS * 2**20 + 16 * 2**20, large_peak

    lines = [json.loads(x) for x in (tmp_path / "large.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(2000) if i % 10]
    first = lines[0]["response"]["body"]["choices"][0]
    assert first["text"] == "answer 1 " + "word " * TOKENS
    assert first["logprobs"]["tokens"] == [f"t{i}" for i in range(TOKENS)]
    assert first["logprobs"]["top_logprobs"][5] == {"a": -1.0, "b": -2.0}
