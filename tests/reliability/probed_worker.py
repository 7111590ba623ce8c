"""``kvbatch worker`` with the reliability suite's probes, put in through the worker's seams.
Takes the worker's flags, and:

- ``--die-after-commit``: exit with status 137 right after the first transaction of results is
  stored, before any of them is acknowledged, the narrowest window of at-least-once delivery
  (the result writer's ``after_commit`` hook);
- ``--holdings-file PATH``: right after each pull, on the loop's thread, count what the worker
  holds (jobs in the engine, deliveries being decided, results not stored yet: what its free
  capacity is computed from) and write the peak to PATH whenever it grows. XPENDING read from
  outside would also count stored results whose ack is on its way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Collection
from pathlib import Path

from worker.loop import Worker
from worker.main import preflight, start_engine
from worker.settings import LOG_FORMAT, add_settings_arguments, settings_from_args

KILLED = 137  # what a SIGKILLed process reports


def _die() -> None:
    os._exit(KILLED)


def record_holdings(worker: Worker, path: Path) -> None:
    pull = worker.intake.pull
    peak = 0

    def pull_and_count(now: float, count: int, held: Collection[str], idle: bool) -> int:
        nonlocal peak
        n = pull(now, count, held, idle)
        holding = len(worker.held) + len(worker.intake) + len(worker.results)
        if holding > peak:
            peak = holding
            path.write_text(str(peak))
        return n

    worker.intake.pull = pull_and_count  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--die-after-commit", action="store_true")
    parser.add_argument("--holdings-file", type=Path)
    add_settings_arguments(parser)
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    preflight(settings)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    worker = Worker(settings, start_engine(settings),
                    after_commit=_die if args.die_after_commit else None)
    if args.holdings_file is not None:
        record_holdings(worker, args.holdings_file)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
