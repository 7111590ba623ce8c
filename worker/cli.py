"""The ``kvbatch`` command line, on top of everything: the producer commands (``jobs``), the
worker, the control plane and the schema migrations. Each subcommand imports its heavy
dependencies lazily, so ``kvbatch submit`` never loads torch.

A command that cannot do its job (database missing or not migrated, Redis or the database
unreachable, unknown model, bad settings) prints one line naming the problem and exits 1;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jobs.api.commands import add_api_commands
from jobs.commands import (
    EXIT_INTERRUPTED,
    add_commands,
    command_client,
    connection_arguments,
    database_url_argument,
)
from jobs.constants import DEFAULT_MODEL
from jobs.demo import add_demo_command
from jobs.settings import connection_settings
from jobs.tables import printable

if TYPE_CHECKING:
    from jobs.remote import RemoteClient
    from jobs.sdk import Client


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
    from worker.main import preflight, run_worker
    from worker.settings import LOG_FORMAT, settings_from_args

    settings = settings_from_args(args)  # bad values fail here, before any logging
    preflight(settings)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return run_worker(settings)


def _control(args: argparse.Namespace) -> int:
    from worker.control.app import run_control
    from worker.control.settings import control_settings_from_args
    from worker.settings import LOG_FORMAT

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return run_control(control_settings_from_args(args), concurrency=args.concurrency,
                       beat=args.beat)


def _db(args: argparse.Namespace) -> int:
    from jobs import db

    url = connection_settings(database_url=args.database_url).database_url
    if args.action == "current" and not db.database_exists(url):
        print(f"base (no database at {url})")
        return 0
    if args.action == "upgrade":
        db.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        db.downgrade(url, args.revision or "base")
    print(db.current_revision(url) or "base")
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    from jobs.pipeline import Pipeline

    if not Path(args.file).is_file():
        raise ValueError(f"no pipeline file {args.file}")
    pipeline = runpy.run_path(args.file, run_name="kvbatch_pipeline").get("pipeline")
    if not isinstance(pipeline, Pipeline):
        raise ValueError(f"{args.file} defines no module-level `pipeline` (a jobs.Pipeline)")
    with _pipeline_client(args) as client:
        try:
            result = pipeline.run(client, output=args.output, errors=args.errors,
                                  progress=args.progress)
        except KeyboardInterrupt:
            print("\ninterrupted: the jobs keep running; run the same command again to resume",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
    print(result.table())
    return 0


def _pipeline_client(args: argparse.Namespace) -> Client | RemoteClient:
    """The HTTP API's client with ``--api`` (or ``$KVBATCH_API_URL``), else the SDK's on the
    command's Redis and SQL."""
    import os

    from jobs.remote import URL_ENV, RemoteClient

    if args.api or os.environ.get(URL_ENV):
        return RemoteClient(args.api, args.api_key, model=args.model)
    return command_client(args, args.model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_command(sub)
    add_commands(sub)
    add_api_commands(sub)
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

    pipeline = sub.add_parser("pipeline", help="run a dataset pipeline (docs/pipelines.md): "
                                               "only what an earlier run did not")
    pipeline.add_argument("action", choices=["run"])
    pipeline.add_argument("file", help="a Python file defining a module-level `pipeline`")
    pipeline.add_argument("-o", "--output", required=True,
                          help="the final rows: Parquet if it ends in .parquet, else JSONL")
    pipeline.add_argument("-e", "--errors", help="the rows that failed, as -o")
    pipeline.add_argument("--model", default=DEFAULT_MODEL,
                          help="served model of the stages that name none")
    pipeline.add_argument("--no-progress", dest="progress", action="store_false",
                          default=None)
    pipeline.add_argument("--api", metavar="URL",
                          help="run through the HTTP API at URL (default $KVBATCH_API_URL; "
                               "unset: on Redis and SQL directly)")
    pipeline.add_argument("--api-key", help="the API key (default $KVBATCH_API_KEY)")
    connection_arguments(pipeline)
    pipeline.set_defaults(func=_pipeline)

    db = sub.add_parser("db", help="migrate the SQL schema (upgrade, downgrade, current)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", help="target revision (head / base by default)")
    database_url_argument(db)
    db.set_defaults(func=_db)

    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="show the traceback of an error, not just its line")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:
        if args.debug:
            raise
        print(f"kvbatch {args.command}: {printable(error_line(exc))}", file=sys.stderr)
        return 1


def error_line(exc: BaseException) -> str:
    """One line saying what went wrong, for people rather than for debuggers."""
    import redis
    from pydantic import ValidationError
    from sqlalchemy.exc import DBAPIError

    from jobs.db import SchemaNotReady
    from jobs.remote import RemoteError
    from jobs.sdk import validation_message

    if isinstance(exc, SchemaNotReady | ValueError) and not isinstance(exc, ValidationError):
        return _first_line(exc)
    if isinstance(exc, ValidationError):
        return validation_message(exc.errors())
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return f"cannot reach Redis: {_first_line(exc)}"
    if isinstance(exc, RemoteError):
        return f"the HTTP API: {_first_line(exc)}"
    if isinstance(exc, DBAPIError):
        return (f"database error: {_first_line(exc.orig or exc)} (is the database reachable and "
                f"migrated? kvbatch db upgrade)")
    return f"{type(exc).__name__}: {_first_line(exc)} (--debug shows the traceback)"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
