"""Many concurrent waiters on one client: ``--jobs`` jobs submitted as one batch
(``AsyncClient.submit_batch``, so that nearly all are still queued when the waits start), then
one ``AsyncJobHandle.result()`` await per job, all at once, served by one worker on a tiny
random Llama.

Prints the errors (goal: none), the Redis connections the client holds (its pool's
connections, the done-channel subscription included; goal: at most 5), the SQL queries of the
client's shared status poll against one query per waiter per second, and the wall time.
Real services (``--redis-url``, ``--database-url``; PostgreSQL), in a schema and key prefix of
the run's own.

    python -m bench.waiters --jobs 10000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench.queue_path import MODEL_NAME, scratch_services, worker_process
from jobs.constants import DEFAULT_REDIS_URL


async def run(services: Any, n: int) -> None:
    from jobs.aio import AsyncClient, AsyncJobHandle

    async with AsyncClient(services.redis_url, services.database_url,
                           key_prefix=services.key_prefix, model=MODEL_NAME) as client:
        reader = client.jobs.reader
        terminal_ids = reader.terminal_ids
        polls: list[int] = []

        def counted(ids: Any, *args: Any, **kwargs: Any) -> set[str]:
            polls.append(len(ids))
            return terminal_ids(ids, *args, **kwargs)

        reader.terminal_ids = counted  # type: ignore[method-assign]
        started = time.perf_counter()
        batch = await client.submit_batch(
            [{"custom_id": f"w{i}", "prompt": f"Say hi to customer {i}."} for i in range(n)],
            max_tokens=4, ignore_eos=True)
        handles = [AsyncJobHandle(client, job_id) for job_id in (await batch.job_ids()).values()]
        submitted = time.perf_counter() - started
        counts = await batch.counts()
        waiting = counts.queued + counts.running
        results = await asyncio.gather(*(h.result(timeout_s=1800) for h in handles),
                                       return_exceptions=True)
        took = time.perf_counter() - started
        errors = [r for r in results if isinstance(r, BaseException)]
        pool = client.jobs.redis.connection_pool
        held = len(pool._available_connections) + len(pool._in_use_connections)  # type: ignore[attr-defined]
        print(f"{n:,} jobs submitted in {submitted:.1f}s, then {n:,} concurrent result() "
              f"awaits ({waiting:,} of the jobs not finished when they started): all done "
              f"{took:.1f}s after the submit began; errors: {len(errors)}"
              + (f" (first: {errors[0]!r})" if errors else ""))
        print(f"Redis connections held by the client: {held} (done-channel subscription "
              f"included)")
        print(f"status polls: {len(polls)} SQL reads of up to {max(polls, default=0):,} ids "
              f"(one query per waiter per second would be ~{int(n * took):,})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1/test")
    parser.add_argument("--out", default="/tmp/kvbatch-bench-waiters")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from engine.testing import make_tiny_model

    args.model = str(make_tiny_model(Path(args.out) / "tiny"))
    args.dtype, args.max_num_seqs, args.null_tokens = "float32", 256, 1
    with scratch_services(args.redis_url, args.database_url) as services, \
            worker_process(services, args, null=False):
        asyncio.run(run(services, args.jobs))


if __name__ == "__main__":
    main()
