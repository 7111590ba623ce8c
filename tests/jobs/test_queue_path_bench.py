"""bench/queue_path.py end to end in its null-engine mode, small: a worker process on the
stand-in engine brings every submitted job to a terminal row, and the run cleans up its
PostgreSQL schema and Redis keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from services import PG_URL, REDIS_URL

from bench import queue_path


def _leftovers() -> tuple[set[str], set[bytes]]:
    """Bench schemas and Redis keys that exist now (a killed run may have left some)."""
    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        schemas = set(conn.scalars(sa.text("SELECT schema_name FROM information_schema.schemata "
                                           "WHERE schema_name LIKE 'kvb_bench_%'")))
    engine.dispose()
    return schemas, set(redis.Redis.from_url(REDIS_URL).scan_iter("kvb-bench-*"))


def test_null_engine_queue_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _leftovers()
    assert queue_path.main(["--mode", "null", "--jobs", "300", "--lone-jobs", "5",
                            "--redis-url", REDIS_URL, "--database-url", PG_URL,
                            "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lone job, submit to terminal row read back (5 jobs): p50" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 300 |")]
    assert float(row.split("|")[3]) > 0  # jobs/s
    assert _leftovers() == before  # the run removed its schema and keys


def test_null_engine_gives_each_request_its_tokens() -> None:
    from engine.sampling_params import SamplingParams

    engine = queue_path.NullEngine(tokens_per_step=3, max_num_seqs=2)
    for i, n in enumerate((5, 1, 4)):
        engine.add_request(f"r{i}", "x", SamplingParams(max_tokens=n))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.token_ids)
    assert finished == {"r0": 5, "r1": 1, "r2": 4}
    assert engine.stats().num_generated_tokens == 10


def test_workers_mode_runs_the_four_ways(tmp_path: Path, tiny_model: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Two tiny-model workers, engine process and thread, default threads and cores split: each
    way brings the jobs to terminal rows, and the table gives each its seconds."""
    import os

    before = _leftovers()
    assert queue_path.main(["--mode", "workers", "--workers", "2", "--model", tiny_model,
                            "--dtype", "float32", "--jobs", "6", "--repeat", "1",
                            "--redis-url", REDIS_URL, "--database-url", PG_URL,
                            "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    split = max(1, (os.cpu_count() or 1) // 2)
    for label in ("process-all", "thread-all", f"process-{split}", f"thread-{split}"):
        assert f"{label}: " in out
        assert (tmp_path / f"worker-{label}-1.log").is_file()  # both workers ran
    rows = [line for line in out.splitlines() if line.startswith(("| default", f"| {split} thr"))]
    assert len(rows) == 2
    for row in rows:
        proc, thread, ratio = (cell.strip() for cell in row.strip("|").split("|")[1:])
        assert float(proc[:-2]) > 0 and float(thread[:-2]) > 0
        assert float(ratio) == pytest.approx(float(proc[:-2]) / float(thread[:-2]), rel=0.02)
    assert _leftovers() == before
