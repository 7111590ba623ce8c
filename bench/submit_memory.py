"""The producer's memory when ``Client.submit_batch`` is given a generator of rows (issue: the
SDK buffered; goal: peak RSS at most 300 MB for a million rows).

Each run is a fresh process: its RSS once the client is connected (the baseline), then its
peak RSS (``VmHWM``) after submitting ``rows`` plain rows made by a generator, with no worker
running, and the time. ``list`` runs hand it the same rows made into a list first, as a
caller that builds its rows up front does: the alternative, in the same run.

Real services (``--redis-url``, ``--database-url``; PostgreSQL), in a schema and key prefix of
the run's own.

    python -m bench.submit_memory --rows 200000 1000000 --list-rows 200000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.queue_path import REPO_ROOT, scratch_services
from jobs.constants import DEFAULT_REDIS_URL

_MEASURE = """
import json, sys, time
def rss_mib(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1]) / 1024
from jobs import Client
mode, n, redis_url, database_url, prefix = sys.argv[1:6]
n = int(n)
client = Client(model="bench", redis_url=redis_url, database_url=database_url,
                key_prefix=prefix)
client.jobs.batch_settings("warm-up")  # connections open before the baseline
base = rss_mib("VmRSS:")
rows = ({"custom_id": f"r{i}", "prompt": f"Write a one-line blurb for item {i}.",
         "max_tokens": 8} for i in range(n))
started = time.perf_counter()
batch = client.submit_batch(list(rows) if mode == "list" else rows, batch_id=f"{mode}-{n}")
seconds = time.perf_counter() - started
assert len(batch.submitted) == n
print(json.dumps({"mode": mode, "rows": n, "seconds": seconds, "base_mib": base,
                  "peak_mib": rss_mib("VmHWM:")}))
"""


def measure(mode: str, rows: int, redis_url: str, database_url: str) -> dict[str, float]:
    with scratch_services(redis_url, database_url) as services:
        out = subprocess.run([sys.executable, "-c", _MEASURE, mode, str(rows), services.redis_url,
                              services.database_url, services.key_prefix],
                             cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--list-rows", type=int, nargs="*", default=[200_000],
                        help="sizes also run with the rows made into a list first")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1/test")
    args = parser.parse_args()
    runs = [("generator", n) for n in args.rows] + [("list", n) for n in args.list_rows]
    print("| rows given as | rows | s | rows/s | RSS before MiB | peak RSS MiB | grown MiB "
          "| grown bytes/row |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, n in runs:
        r = measure(mode, n, args.redis_url, args.database_url)
        grown = r["peak_mib"] - r["base_mib"]
        print(f"| {mode} | {n:,} | {r['seconds']:.1f} | {n / r['seconds']:,.0f} "
              f"| {r['base_mib']:.0f} | {r['peak_mib']:.0f} | {grown:.0f} "
              f"| {grown * 2**20 / n:.0f} |", flush=True)


if __name__ == "__main__":
    main()
