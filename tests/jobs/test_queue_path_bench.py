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
