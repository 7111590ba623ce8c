"""The ``kvbatch`` command line. Each subcommand imports its heavy dependencies lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _bench(bench_args: list[str]) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"
    if not script.is_file():
        print("kvbatch bench runs bench/throughput.py from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *bench_args]
    sys.path.insert(0, str(script.parents[1]))
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _worker(args: argparse.Namespace) -> int:
    import logging

    from worker.main import run_worker
    from worker.settings import settings_from_args

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(settings_from_args(args))


def _control(args: argparse.Namespace) -> int:
    import logging

    from worker.control.app import run_control
    from worker.control.settings import control_settings_from_args

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_control(control_settings_from_args(args), concurrency=args.concurrency,
                       beat=args.beat)


def _db(args: argparse.Namespace) -> int:
    from jobs import db

    if args.action == "upgrade":
        db.upgrade(args.database_url, args.revision or "head")
    elif args.action == "downgrade":
        db.downgrade(args.database_url, args.revision or "base")
    print(db.current_revision(args.database_url) or "base")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from jobs.commands import add_commands
    from jobs.demo import add_demo_command

    add_demo_command(sub)
    add_commands(sub)

    # Arguments after `bench` go to bench/throughput.py untouched (see main).
    sub.add_parser("bench", help="engine vs transformers throughput (bench/throughput.py)")

    from worker.settings import add_settings_arguments

    worker = sub.add_parser("worker", help="run a worker: Redis stream → engine → SQL")
    add_settings_arguments(worker)
    worker.set_defaults(func=_worker)

    from worker.control.settings import add_control_arguments

    control = sub.add_parser("control", help="run the control plane: a Celery worker with the "
                                             "beat schedule (deadlines, batches, retention)")
    control.add_argument("--concurrency", type=int, default=4, help="task threads")
    control.add_argument("--beat", action=argparse.BooleanOptionalAction, default=True,
                         help="embed the beat scheduler (run exactly one with it)")
    add_control_arguments(control)
    control.set_defaults(func=_control)

    import os

    from jobs.db import DEFAULT_DATABASE_URL

    db = sub.add_parser("db", help="migrate the SQL schema (upgrade, downgrade, current)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", help="target revision (head / base by default)")
    db.add_argument("--database-url",
                    default=os.environ.get("KVBATCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    db.set_defaults(func=_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
