"""Load: jobs through the SDK into real Redis and PostgreSQL, two worker processes.

CI runs 2,000 jobs; ``KVBATCH_SOAK=1`` runs 10,000, then keeps submitting for
``KVBATCH_SOAK_S`` seconds (default 300). Worker memory must not grow with the queue: the
workers hold at most ``max_num_seqs + waiting_buffer`` jobs each (backpressure), counted by
each worker on its own thread right after each pull (``probed_worker.py --holdings-file``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import redis
import sqlalchemy as sa
from chaos import MODEL, audit, wait_until
from services import SOAK
from test_faults import record

from jobs.constants import Keys
from jobs.queue import JobQueue
from jobs.sdk import Client

RSS_GROWTH_LIMIT_KIB = 150 * 1024
MAX_NUM_SEQS, WAITING_BUFFER = 32, 8


def _rows(start: int, n: int) -> list[dict]:  # type: ignore[type-arg]
    return [{"custom_id": f"row-{i}", "prompt": f"load row {i}: summarize {i % 13}",
             "max_tokens": 8, "temperature": 0.0} for i in range(start, start + n)]


def test_load_through_the_sdk(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                              pg_url: str, workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from services import REDIS_URL

    n_jobs = 10_000 if SOAK else 2_000
    soak_s = float(os.environ.get("KVBATCH_SOAK_S", "300")) if SOAK else 0.0
    holdings = {name: tmp_path / f"{name}.holdings" for name in ("l-a", "l-b")}
    procs = [workers.start(name, probes=["--holdings-file", str(path)],
                           max_num_seqs=MAX_NUM_SEQS, waiting_buffer=WAITING_BUFFER)
             for name, path in holdings.items()]
    q = JobQueue(redis_client, MODEL, keys)
    with Client(REDIS_URL, pg_url, key_prefix=keys.prefix, model=MODEL) as client:
        wait_until(lambda: len(q.live_workers()) == 2, 60, what="workers up")
        time.sleep(3.0)  # engine warm-up (first decode compiles)
        baseline = {w.name: w.rss() for w in procs}
        samples: dict[str, list[int]] = {w.name: [] for w in procs}
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                for w in procs:
                    samples[w.name].append(w.rss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        batch = client.submit_batch(_rows(0, n_jobs), batch_id="load", chunk_size=1000)
        submitted_s = time.monotonic() - t0
        counts = batch.wait(timeout_s=900)
        elapsed_s = time.monotonic() - t0
        total = n_jobs
        soak_rounds = 0
        while time.monotonic() - t0 < elapsed_s + soak_s:  # the soak: keep it coming
            more = client.submit_batch(_rows(total, 1000), batch_id=f"soak-{soak_rounds}")
            more.wait(timeout_s=600)
            total += 1000
            soak_rounds += 1
        stop.set()
        sampler.join(5)
    assert counts.succeeded == n_jobs, counts
    ids = [r[0] for r in _all_ids(pg_engine)]
    result = audit(pg_engine, ids)
    assert result.lost == 0 and result.duplicate_terminal_rows == 0, result
    assert len(ids) == total
    wait_until(lambda: q.depth() == (0, 0), 30, what="queue drained")
    held_peak = {name: int(path.read_text()) for name, path in holdings.items()}
    # In flight capped by backpressure, not the queue; both workers took part.
    assert all(0 < peak <= MAX_NUM_SEQS + WAITING_BUFFER for peak in held_peak.values()), held_peak
    growth = {n: max(s) - baseline[n] for n, s in samples.items() if s}
    assert all(g < RSS_GROWTH_LIMIT_KIB for g in growth.values()), growth
    assert all(w.alive() for w in procs)
    record("load", jobs=total, workers=2, submit_s=round(submitted_s, 1),
           elapsed_s=round(elapsed_s, 1), jobs_per_s=round(n_jobs / elapsed_s, 1),
           max_in_flight=held_peak, rss_baseline_mib={n: round(v / 1024) for n, v in
                                                          baseline.items()},
           rss_growth_mib={n: round(g / 1024, 1) for n, g in growth.items()},
           soak_s=soak_s, lost=result.lost,
           duplicate_terminal_rows=result.duplicate_terminal_rows)


def _all_ids(engine: sa.Engine) -> list[tuple[str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id FROM jobs")).all()]
