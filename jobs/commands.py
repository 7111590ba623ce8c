"""The producer subcommands of ``kvbatch``: ``submit``, ``status``, ``cancel``, ``stats``.

Connection flags default to ``KVBATCH_REDIS_URL`` / ``KVBATCH_DATABASE_URL`` /
``KVBATCH_KEY_PREFIX``, like the SDK and the worker. Errors are raised; the command line
(``worker.cli``) turns them into one line and an exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from jobs.constants import DEFAULT_MODEL
from jobs.db import check_schema, make_engine
from jobs.schemas import JobStatus
from jobs.sdk import BatchHandle, Client, JobHandle
from jobs.settings import connection_settings
from jobs.tables import format_stats, format_table, printable

EXIT_USAGE = 2
CONNECT_TIMEOUT_S = 5.0
EXIT_INTERRUPTED = 130
GC_YOUNG_OBJECTS = 50_000  # allocations between collections of the youngest generation
GIL_SWITCH_INTERVAL_S = 0.0005  # submit: 100,000 rows in 5.3-5.6 s, 6.0-6.5 s at 5 ms


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the producer subcommands on the ``kvbatch`` parser."""
    submit = sub.add_parser(
        "submit", help="run a dataset (JSONL, plain or OpenAI batch rows; or CSV) into a "
                       "results file; re-run the same command to resume")
    submit.add_argument("input", type=Path)
    submit.add_argument("-o", "--output", type=Path, required=True, help="results (JSONL)")
    submit.add_argument("-e", "--errors", default="inline",
                        help="file for rows that did not succeed, or 'inline' (default)")
    submit.add_argument("--model", default=DEFAULT_MODEL, help="served model for every row")
    submit.add_argument("--system-prompt", help="prepended to rows without a system message")
    submit.add_argument("--max-tokens", type=int, help="default for rows that set none")
    submit.add_argument("--temperature", type=float, help="default for rows that set none")
    submit.add_argument("--top-p", type=float, help="default for rows that set none")
    submit.add_argument("--seed", type=int, help="default for rows that set none")
    submit.add_argument("--priority", type=int, default=0, help="lower runs first")
    submit.add_argument("--batch-id", help="default: the one recorded in OUTPUT.batch by an "
                                           "earlier run on the same input (resume), else a "
                                           "new random id")
    submit.add_argument("--webhook-url",
                        help="POSTed the batch's completion event (by kvbatch control)")
    submit.add_argument("--response-format", type=Path, metavar="FILE.json",
                        help="default response_format for rows that set none (OpenAI's "
                             "{\"type\": \"json_schema\", \"json_schema\": {...}}, or "
                             "regex, choice, grammar)")
    submit.add_argument("--strict", action="store_true",
                        help="refuse the whole file if any row cannot run (default: such a row "
                             "gets an error line and the others run)")
    submit.add_argument("--no-progress", dest="progress", action="store_false")
    submit.add_argument("--no-wait", dest="wait", action="store_false",
                        help="return once every row is submitted (run the same command again "
                             "to collect the results)")
    connection_arguments(submit)
    submit.set_defaults(func=_submit)

    status = sub.add_parser("status", help="counts and statistics of a batch, or one job")
    status.add_argument("id", help="a batch id or a job id")
    connection_arguments(status)
    status.set_defaults(func=_status)

    cancel = sub.add_parser("cancel", help="cancel a job, or every unfinished job of a batch")
    cancel.add_argument("id", help="a job id or a batch id")
    connection_arguments(cancel)
    cancel.set_defaults(func=_cancel)

    stats = sub.add_parser("stats", help="aggregate statistics of finished jobs")
    stats.add_argument("--batch", help="only this batch")
    stats.add_argument("--since", type=_since,
                       help="only jobs finished since: a duration (30m, 2h, 1d) or ISO time")
    connection_arguments(stats)
    stats.set_defaults(func=_stats)


def database_url_argument(parser: argparse.ArgumentParser) -> None:
    """``--database-url`` (commands that need only the database)."""
    parser.add_argument("--database-url", help="default $KVBATCH_DATABASE_URL, else "
                                               "sqlite:///kvbatch.db")


def connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--redis-url``, ``--database-url``, ``--key-prefix``."""
    parser.add_argument("--redis-url", help="default $KVBATCH_REDIS_URL, else local Redis")
    database_url_argument(parser)
    parser.add_argument("--key-prefix", help="default $KVBATCH_KEY_PREFIX, else kvbatch")


def command_client(args: argparse.Namespace, model: str = DEFAULT_MODEL) -> Client:
    """A client on the command's services, once the database is known to be at this code's
    schema (``jobs.db.SchemaNotReady`` names the fix otherwise; nothing is created)."""
    conn = connection_settings(args.redis_url, args.database_url, args.key_prefix)
    database = make_engine(conn.database_url, connect_timeout_s=CONNECT_TIMEOUT_S)
    try:
        check_schema(database)  # a database that does not answer fails within seconds
    finally:
        database.dispose()
    return Client(conn.redis_url, conn.database_url, key_prefix=conn.key_prefix, model=model)


def _response_format(path: Path) -> dict[str, Any]:
    """The response format in ``path``, checked (``ValueError`` says what is wrong)."""
    from engine.sampling_params import SamplingParams

    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a response format is a JSON object with a 'type'")
    try:
        SamplingParams(response_format=value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return value


def _submit(args: argparse.Namespace) -> int:
    from jobs.bulk import BulkOptions, count_rows, iter_rows, resume_batch_id, run_bulk

    try:
        total = count_rows(args.input)
        if args.strict:  # a malformed line is named before any service is asked for
            for _ in iter_rows(args.input, strict=True):
                pass
        defaults: dict[str, Any] = {
            k: v for k, v in (("max_tokens", args.max_tokens),
                              ("temperature", args.temperature), ("top_p", args.top_p),
                              ("seed", args.seed)) if v is not None}
        if args.response_format is not None:
            defaults["response_format"] = _response_format(args.response_format)
    except (OSError, ValueError) as exc:
        print(f"kvbatch submit: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    try:
        batch_id = resume_batch_id(args.input, args.output, args.batch_id)
    except ValueError as exc:
        print(f"kvbatch submit: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    opts = BulkOptions(
        input=args.input, output=args.output,
        errors=None if args.errors == "inline" else Path(args.errors),
        batch_id=batch_id, model=args.model,
        system_prompt=args.system_prompt, defaults=defaults, priority=args.priority,
        webhook_url=args.webhook_url, progress=args.progress, strict=args.strict,
        wait=args.wait,
    )
    with command_client(args, args.model) as client, _bulk_load_process():
        print(f"batch {opts.batch_id}: {total} rows on {opts.model}", file=sys.stderr)
        if not client.serves(opts.model):
            print(f"warning: no live worker serves {opts.model!r}; rows wait in the queue "
                  f"until one starts (kvbatch worker --model …)", file=sys.stderr)
        try:
            tally = run_bulk(client, lambda: iter_rows(args.input, strict=args.strict), opts,
                             total)
        except (OSError, ValueError) as exc:
            print(f"kvbatch submit: {printable(str(exc))}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("\ninterrupted: the jobs keep running; run the same command again to "
                  "resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        elapsed = time.monotonic() - tally.started
        if not opts.wait:
            print(f"{tally.submitted} rows submitted in {elapsed:.1f} s "
                  f"({tally.submitted / max(elapsed, 1e-9):.0f} rows/s), {tally.skipped} were "
                  f"already in {opts.output}; run the same command again to collect the "
                  "results")
            return 0
        print(f"\n{tally.written} rows written in {elapsed:.1f} s ({tally.failed} did not "
              f"succeed), {tally.skipped} were already in {opts.output}")
        print(format_stats(client.stats(batch_id=opts.batch_id)))
    return 0


@contextlib.contextmanager
def _bulk_load_process() -> Iterator[None]:
    """The interpreter tuned for a bulk load while it runs (restored after)."""
    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    # A bulk load makes millions of objects that live for a chunk: with the collector's
    # default thresholds its full passes, over every object the imports made too, took a
    # quarter of the submit's CPU. Startup's objects are kept out of them, and they run
    # less often (cycles are few here: SQL sessions, one a chunk).
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *threshold[1:])
    # The thread that stores a chunk while the next is checked waits on the database many
    # times a chunk, then for the GIL: 5 ms each by default, PostgreSQL idle meanwhile.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _status(args: argparse.Namespace) -> int:
    with command_client(args) as client:
        counts = BatchHandle(client.jobs, args.id).counts()
        if counts.total:
            rows = [(s.value, n) for s in sorted(JobStatus) if (n := getattr(counts, s.value))]
            print(f"batch {args.id}")
            print(format_table(("status", "jobs"), [*rows, ("total", counts.total)]))
            print()
            print(format_stats(client.stats(batch_id=args.id)))
            return 0
        try:
            info = client.job(args.id).info()
        except KeyError:
            print(f"kvbatch status: no batch or job {args.id!r}", file=sys.stderr)
            return 1
        stats = info.stats
        fields = [("job", info.id), ("batch", info.batch_id), ("custom_id", info.custom_id),
                  ("model", info.model), ("status", info.status.value),
                  ("attempts", info.attempts), ("worker", info.worker_id),
                  ("created", info.created_at), ("finished", info.finished_at),
                  ("error", info.error),
                  ("tokens (prompt/cached/generated)",
                   f"{stats.prompt_tokens}/{stats.cached_prompt_tokens}/"
                   f"{stats.generated_tokens}" if stats else None),
                  ("e2e s", stats.e2e_s if stats else None)]
        print(format_table(("field", "value"), [(k, "-" if v is None else str(v))
                                                for k, v in fields]))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    with command_client(args) as client:
        batch = BatchHandle(client.jobs, args.id)
        if batch.counts().total:
            n = batch.cancel()
            print(f"batch {args.id}: {n} unfinished jobs cancelled or asked to stop")
            return 0
        status = JobHandle(client.jobs, args.id).cancel()
        if status is None:
            print(f"kvbatch cancel: no batch or job {args.id!r}", file=sys.stderr)
            return 1
        print(f"job {args.id}: {status.value}"
              + (" (its worker is asked to stop it)" if status is JobStatus.RUNNING else ""))
    return 0


def _stats(args: argparse.Namespace) -> int:
    with command_client(args) as client:
        print(format_stats(client.stats(batch_id=args.batch, since=args.since)))
    return 0


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(value: str) -> timedelta | datetime:
    match = _DURATION.match(value)
    if match:
        return timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration (30m, 2h) or ISO time: {value!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
