"""A large dataset's backlog and what still gets through it, in one run (issue: million-row
datasets, priorities, fair share).

1. ``kvbatch submit FILE --no-wait`` of ``--rows`` plain rows with no worker running: the
   producer's peak RSS, the time and rows/s, Redis ``used_memory`` above what it was before,
   the stream's length and the size of the ``jobs`` table.
2. A worker on a tiny random Llama starts behind that backlog. ``--urgent`` times, one job at
   ``priority=-10`` is submitted and waited for: its time to first token from submission
   (``job_stats.ttft_s``), p50 and max.
3. A 10-row batch at the backlog's priority, submitted after it: the time until all 10 are
   done, and how many rows of the big batch finished meanwhile.
4. With the worker stopped, ``kvbatch cancel`` of the big batch: its time, Redis
   ``used_memory`` and the stream after.

Real services (``--redis-url``, ``--database-url``; PostgreSQL), in a schema and key prefix of
the run's own.

    python -m bench.backlog --rows 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis
from sqlalchemy import text

from bench.queue_path import MODEL_NAME, REPO_ROOT, scratch_services, worker_process
from jobs.constants import DEFAULT_REDIS_URL
from jobs.schemas import JobSpec, JobStatus

SAMPLING = {"max_tokens": 8, "ignore_eos": True}


def write_rows(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}",
                                "prompt": f"Write a one-line product blurb for item {i}."}) + "\n")


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def kvbatch(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run a ``kvbatch`` command: (seconds, its peak RSS in MiB). The peak is the process's
    ``VmHWM`` after its exec, read until it exits: its rusage would count this process's
    image too (the child starts as a fork of it, and Linux keeps that peak across exec)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", *args], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL)
    peak_kib = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak_kib = int(status.split("VmHWM:")[1].split()[0])
        time.sleep(0.1)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return time.perf_counter() - started, peak_kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--urgent", type=int, default=20)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1/test")
    parser.add_argument("--out", default="/tmp/kvbatch-bench-backlog")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "rows.jsonl"
    write_rows(data, args.rows)
    r = redis.Redis.from_url(args.redis_url, decode_responses=True)
    from engine.testing import make_tiny_model

    args.model = str(make_tiny_model(out / "tiny"))
    args.dtype, args.max_num_seqs, args.null_tokens = "float32", 256, 1

    with scratch_services(args.redis_url, args.database_url) as services:
        env = {**os.environ, "KVBATCH_REDIS_URL": services.redis_url,
               "KVBATCH_DATABASE_URL": services.database_url,
               "KVBATCH_KEY_PREFIX": services.key_prefix}
        before = used_memory(r)
        seconds, rss_mib = kvbatch(["submit", str(data), "-o", str(out / "results.jsonl"),
                                    "--no-wait", "--no-progress", "--model", MODEL_NAME,
                                    "--batch-id", "backlog", "--max-tokens", "8"], env)
        from jobs.client import JobClient
        from jobs.queue import JobQueue

        jobs = JobClient(r, services.database_url, key_prefix=services.key_prefix)
        stream = JobQueue(r, MODEL_NAME, jobs.keys)
        with jobs.engine.connect() as conn:
            table_mib = conn.scalar(text("SELECT pg_total_relation_size('jobs')")) / 2**20
        print(f"submit: {args.rows:,} rows in {seconds:.1f}s ({args.rows / seconds:,.0f} rows/s), "
              f"producer peak RSS {rss_mib:.0f} MiB, Redis +{(used_memory(r) - before) / 2**20:.1f}"
              f" MiB, stream {stream.length():,} entries, jobs table {table_mib:,.0f} MiB")

        with worker_process(services, args, null=False):
            ttfts = []
            for i in range(args.urgent):
                spec = JobSpec(model=MODEL_NAME, prompt=f"urgent {i}", priority=-10,
                               sampling=SAMPLING)
                jobs.submit([spec])
                jobs.wait_terminal([spec.id], timeout_s=120)
                with jobs.engine.connect() as conn:
                    ttfts.append(conn.scalar(text(
                        "SELECT ttft_s FROM job_stats WHERE job_id = :id"), {"id": spec.id}))
            print(f"urgent (priority -10) behind the backlog, {len(ttfts)} tries: time to first "
                  f"token p50 {statistics.median(ttfts):.2f}s, max {max(ttfts):.2f}s")

            def big_done() -> int:
                return jobs.count_by_status("backlog").get(JobStatus.SUCCEEDED, 0)

            small = [JobSpec(model=MODEL_NAME, prompt=f"small {i}", batch_id="small",
                             custom_id=f"s{i}", sampling=SAMPLING) for i in range(10)]
            done_before, started = big_done(), time.perf_counter()
            jobs.submit_batch("small", small)
            jobs.wait_terminal([s.id for s in small], timeout_s=600, batch_id="small")
            took = time.perf_counter() - started
            print(f"fair share: a 10-row batch after the {args.rows:,}-row one finished in "
                  f"{took:.2f}s, while {big_done() - done_before:,} rows of the big one did")

        seconds, _ = kvbatch(["cancel", "backlog"], env)  # the worker is stopped
        print(f"cancel: {seconds:.1f}s; Redis +{(used_memory(r) - before) / 2**20:.1f} MiB "
              f"(done markers included), stream {stream.length():,} entries")
        jobs.close()


if __name__ == "__main__":
    main()
