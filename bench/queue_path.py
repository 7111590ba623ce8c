"""The queue path against the engine alone: what a user loses by going through Redis, a
worker and PostgreSQL, measured in one run.

Two modes:

* ``engine`` (default): the same jobs (chat prompts sharing a ~110-token system prompt,
  outputs of 8-64 tokens, greedy, ``ignore_eos``) run through ``LLMEngine.generate`` in this
  process and through the SDK, Redis, a ``kvbatch worker`` process and PostgreSQL (first
  submission to last terminal row), alternately ``--repeat`` times, both engines warm (a
  shared machine drifts by 10-20 % between runs; pairs side by side and best-of-N see past
  it). Prints useful tok/s both ways, the ratio of the best runs and the median of the
  pairs' ratios. ``--compare-thread`` adds a worker whose engine runs on a thread of its
  own process (``--no-engine-process``), the design this one replaced.
* ``null``: a worker process whose engine is a stand-in (:class:`NullEngine`: every request
  gets ``--null-tokens`` tokens a step, at no cost), so what is measured is the queue's own
  cost: the job rate from submission to terminal SQL row with one worker, and the latency of
  a lone job (submit, then wait for its row), whose p50 is the per-job queue overhead.

* ``workers``: ``--workers`` workers on this host (2 by default) and the same
  ``--jobs`` jobs through them: the engine in its own process against on a thread, each
  with the default threads (the workers split the host's cores themselves:
  ``worker/cpu_share.py``) and with the split set (``KVBATCH_CPU_THREADS``), alternately
  ``--repeat`` times, the best of each.

Everything runs against real services (``--redis-url``, ``--database-url``: local Redis and
PostgreSQL by default), in a PostgreSQL schema and a Redis key prefix of the run's own,
removed at the end.

    python -m bench.queue_path --jobs 128 512
    python -m bench.queue_path --mode null --jobs 20000
    python -m bench.queue_path --mode workers --model TINY_MODEL_DIR --jobs 3000 --repeat 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

REPO_ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a careful assistant for a data team. Answer in plain English, keep answers "
          "short, say so when you are not sure, never invent numbers, cite the table a figure "
          "comes from, prefer lists to long paragraphs, and explain any assumption you make. "
          "When a question is ambiguous, state the reading you chose before answering it. "
          "Use metric units, ISO dates, and round figures to three significant digits.")
MODEL_NAME = "queue-path-bench"


# -- the stand-in engine ----------------------------------------------------------------------

@dataclass
class _NullRequest:
    request_id: str
    max_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)


class NullEngine:
    """An engine that costs nothing: each step gives every request ``tokens_per_step`` tokens
    (token id 0) until its ``max_tokens``; ``max_num_seqs`` run at once."""

    has_chat_template = False

    def __init__(self, tokens_per_step: int = 1, max_num_seqs: int = 256) -> None:
        self.tokens_per_step = tokens_per_step
        self.max_num_seqs = max_num_seqs
        self._running: dict[str, _NullRequest] = {}
        self._waiting: list[_NullRequest] = []
        self._aborted: list[str] = []
        self._steps = 0
        self._generated = 0

    def add_request(self, request_id: str, prompt: object, params: object, *,
                    priority: int = 0, lora: str | None = None) -> None:
        if lora is not None:
            raise ValueError(f"the null engine serves no LoRA adapter ({lora!r})")
        self._waiting.append(_NullRequest(request_id, params.max_tokens,  # type: ignore[attr-defined]
                                          time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        self._aborted.append(request_id)

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting or self._aborted)

    def step(self) -> list:  # list[RequestOutput]
        from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

        outputs = []
        now = time.monotonic()
        for request_id in self._aborted:
            req = self._running.pop(request_id, None)
            self._waiting = [r for r in self._waiting if r.request_id != request_id]
            outputs.append(RequestOutput(request_id, [0], [CompletionOutput(
                0, req.tokens if req else [], "", "abort")], True,
                RequestMetrics(arrival_time=now, finish_time=now)))
        self._aborted = []
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.pop(0)
            self._running[req.request_id] = req
        self._steps += 1
        for req in list(self._running.values()):
            new = min(self.tokens_per_step, req.max_tokens - len(req.tokens))
            req.tokens += [0] * new
            self._generated += new
            done = len(req.tokens) >= req.max_tokens
            metrics = RequestMetrics(arrival_time=req.arrival, first_scheduled_time=req.arrival,
                                     first_token_time=req.arrival, num_prompt_tokens=1,
                                     num_generated_tokens=len(req.tokens),
                                     finish_time=now if done else None)
            outputs.append(RequestOutput(req.request_id, [0], [CompletionOutput(
                0, list(req.tokens), "x" * len(req.tokens) if done else "",
                "length" if done else None)], done, metrics))
            if done:
                del self._running[req.request_id]
        return outputs

    def stats(self):  # type: ignore[no-untyped-def]
        from engine.outputs import EngineStats

        return EngineStats(
            num_running=len(self._running), num_waiting=len(self._waiting), num_swapped=0,
            num_kv_blocks_total=1, num_kv_blocks_free=1, kv_usage=0.0, kv_bytes_per_block=0,
            num_generated_tokens=self._generated, num_steps=self._steps,
            num_batched_tokens=self._generated)


def serve_null(tokens_per_step: int) -> int:
    """Run a worker on a :class:`NullEngine` until SIGTERM (settings from the environment)."""
    import signal

    from worker.loop import Worker
    from worker.settings import worker_settings

    settings = worker_settings()
    worker = Worker(settings, NullEngine(tokens_per_step, settings.engine.max_num_seqs))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop(drain=False))
    return worker.run()


# -- services -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Services:
    redis_url: str
    database_url: str  # the run's own schema
    key_prefix: str


@contextmanager
def scratch_services(redis_url: str, database_url: str) -> Iterator[Services]:
    """A PostgreSQL schema (migrated) and a Redis key prefix of this run's own; removed after."""
    import redis

    from jobs import db

    run = uuid.uuid4().hex[:10]
    schema = f"kvb_bench_{run}"
    admin = db.make_engine(database_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{database_url}?options=-csearch_path%3D{schema}"
    db.upgrade(url)
    prefix = f"kvb-bench-{run}"
    try:
        yield Services(redis_url, url, prefix)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}:*", count=1000):
            client.delete(key)


@contextmanager
def worker_process(services: Services, args: argparse.Namespace, null: bool,
                   engine_process: bool = True, name: str | None = None,
                   env: dict[str, str] | None = None, live: int = 1) -> Iterator[None]:
    """A worker process for the run's services (its engine in a child process unless not
    ``engine_process``; ``env`` adds settings, ``name`` names its log); returns once
    ``live`` workers are (this one the last of them), stopped after."""
    from jobs.queue import live_workers
    from jobs.sdk import Client

    env = {**os.environ, "KVBATCH_REDIS_URL": services.redis_url,
           "KVBATCH_DATABASE_URL": services.database_url,
           "KVBATCH_KEY_PREFIX": services.key_prefix, "KVBATCH_MODEL": args.model,
           "KVBATCH_SERVED_MODEL_NAME": MODEL_NAME, "KVBATCH_DTYPE": args.dtype,
           "KVBATCH_MAX_NUM_SEQS": str(args.max_num_seqs),
           "KVBATCH_ENGINE_PROCESS": str(engine_process).lower(), **(env or {})}
    if null:
        cmd = [sys.executable, "-m", "bench.queue_path", "--serve-null",
               "--null-tokens", str(args.null_tokens)]
    else:
        cmd = [sys.executable, "-m", "worker.cli", "worker"]
    name = name or ("null" if null else "engine" if engine_process else "engine-thread")
    log = open(Path(args.out) / f"worker-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(services.redis_url, services.database_url, key_prefix=services.key_prefix,
                    model=MODEL_NAME) as client:
            deadline = time.monotonic() + 300
            while len(live_workers(client.jobs.redis, client.jobs.keys)) < live:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not start; see {log.name}")
                time.sleep(0.2)
        yield
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# -- workloads and measurements -------------------------------------------------------------

def _rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"custom_id": f"r{i}", "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question {i}: summarise table t{i % 97} in "
                                            f"{rng.randint(1, 5)} points."}],
             "max_tokens": rng.randint(8, 64), "temperature": 0.0, "ignore_eos": True}
            for i in range(n)]


def direct_engine(args: argparse.Namespace, warm_rows: list[dict]) -> Any:
    """The bench's own ``LLMEngine``, warmed on ``warm_rows``."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype,
                                    max_num_seqs=args.max_num_seqs))
    engine.generate([r["messages"] for r in warm_rows], SamplingParams(max_tokens=2))
    return engine


def run_direct(engine: Any, rows: list[dict]) -> tuple[float, int]:
    """(seconds, output tokens) of the rows through ``engine.generate``."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in rows]
    start = time.perf_counter()
    outs = engine.generate([r["messages"] for r in rows], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def run_queue(services: Services, rows: list[dict]) -> tuple[float, int, float]:
    """(seconds from the first submission to the last terminal row, output tokens, seconds
    spent submitting) of the rows through the SDK and a running worker."""
    from jobs.sdk import Client

    with Client(services.redis_url, services.database_url, key_prefix=services.key_prefix,
                model=MODEL_NAME) as client:
        start = time.perf_counter()
        batch = client.submit_batch(rows, batch_id=f"b-{uuid.uuid4().hex[:8]}")
        submitted = time.perf_counter() - start
        counts = batch.wait(timeout_s=3600)
        elapsed = time.perf_counter() - start
        if counts.succeeded != len(rows):
            raise RuntimeError(f"not every job succeeded: {counts}")
        stats = client.stats(batch_id=batch.id)
    return elapsed, stats.generated_tokens, submitted


def lone_job_latencies(services: Services, n: int) -> list[float]:
    """Seconds from ``submit()`` to the job's terminal row being read, one job at a time."""
    from jobs.sdk import Client

    latencies = []
    with Client(services.redis_url, services.database_url, key_prefix=services.key_prefix,
                model=MODEL_NAME) as client:
        for _ in range(n):
            start = time.perf_counter()
            client.submit(raw_prompt="x", max_tokens=1).result(timeout_s=60)
            latencies.append(time.perf_counter() - start)
    return latencies


def engine_mode(args: argparse.Namespace) -> int:
    """Direct against queue path, alternately, per job count and worker kind."""
    warm_rows = [{**r, "max_tokens": 2} for r in _rows(4)]
    engine = direct_engine(args, warm_rows)
    print("| worker's engine | jobs | output tokens | direct tok/s | queue path tok/s | "
          "ratio of best | median ratio | submit s |")
    print("|---|---|---|---|---|---|---|---|")
    kinds = [("process", True)] + ([("thread", False)] if args.compare_thread else [])
    with scratch_services(args.redis_url, args.database_url) as services:
        for label, in_child in kinds:
            with worker_process(services, args, null=False, engine_process=in_child):
                run_queue(services, warm_rows)
                for n in args.jobs:
                    rows = _rows(n)
                    direct, queued, submits = [], [], []
                    for _ in range(args.repeat):
                        direct_s, direct_tokens = run_direct(engine, rows)
                        queue_s, queue_tokens, submit_s = run_queue(services, rows)
                        assert queue_tokens == direct_tokens, (queue_tokens, direct_tokens)
                        direct.append(direct_tokens / direct_s)
                        queued.append(queue_tokens / queue_s)
                        submits.append(submit_s)
                    ratios = [q / d for q, d in zip(queued, direct, strict=True)]
                    print(f"| {label} | {n} | {direct_tokens} | {max(direct):.1f} | "
                          f"{max(queued):.1f} | {max(queued) / max(direct):.3f} | "
                          f"{statistics.median(ratios):.3f} | {statistics.median(submits):.2f} |",
                          flush=True)
    return 0


def workers_mode(args: argparse.Namespace) -> int:
    """``--workers`` workers on this host, the same jobs through them in four ways: the engine
    in a child process or on a thread, each with the default threads (which the workers
    split) and with the split set (``KVBATCH_CPU_THREADS``), alternately ``--repeat`` times;
    prints the best seconds of each."""
    from contextlib import ExitStack

    rows = _rows(args.jobs[0])
    warm_rows = [{**r, "max_tokens": 2} for r in _rows(4 * args.workers, seed=1)]
    split = max(1, (os.cpu_count() or 1) // args.workers)
    ways = [(in_child, threads) for in_child in (True, False) for threads in (None, split)]
    best: dict[tuple[bool, int | None], float] = {}
    with scratch_services(args.redis_url, args.database_url) as services:
        for _ in range(args.repeat):
            for in_child, threads in ways:
                env = {"KVBATCH_CPU_THREADS": str(threads)} if threads else {}
                label = f"{'process' if in_child else 'thread'}-{threads or 'all'}"
                with ExitStack() as stack:
                    for k in range(args.workers):
                        stack.enter_context(worker_process(
                            services, args, null=False, engine_process=in_child,
                            name=f"{label}-{k}", env=env, live=k + 1))
                    run_queue(services, warm_rows)
                    seconds, _, _ = run_queue(services, rows)
                best[in_child, threads] = min(best.get((in_child, threads), seconds), seconds)
                print(f"{label}: {seconds:.1f} s", flush=True)
    print(f"| {args.workers} workers, {len(rows)} jobs | engine process | engine thread | "
          "process / thread |")
    print("|---|---|---|---|")
    for threads in (None, split):
        proc, thread = best[True, threads], best[False, threads]
        print(f"| {'default' if threads is None else f'{threads} threads each'} | "
              f"{proc:.3f} s | {thread:.3f} s | {proc / thread:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["engine", "null", "workers"], default="engine")
    parser.add_argument("--workers", type=int, default=2, help="workers mode: workers")
    parser.add_argument("--jobs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="engine mode: runs each way, "
                                                              "alternating")
    parser.add_argument("--compare-thread", action="store_true",
                        help="engine mode: also a worker with its engine on a thread")
    parser.add_argument("--null-tokens", type=int, default=8, help="null engine: tokens a "
                                                                   "request gets per step")
    parser.add_argument("--lone-jobs", type=int, default=200, help="null mode: jobs timed "
                                                                   "one at a time")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--database-url",
                        default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"))
    parser.add_argument("--serve-null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_null:
        return serve_null(args.null_tokens)
    Path(args.out).mkdir(parents=True, exist_ok=True)

    if args.mode == "engine":
        return engine_mode(args)
    if args.mode == "workers":
        return workers_mode(args)
    with scratch_services(args.redis_url, args.database_url) as services, \
            worker_process(services, args, null=True):
        lone = lone_job_latencies(services, args.lone_jobs)
        print(f"lone job, submit to terminal row read back ({len(lone)} jobs): p50 "
              f"{statistics.median(lone) * 1e3:.1f} ms, p90 "
              f"{statistics.quantiles(lone, n=10)[-1] * 1e3:.1f} ms")
        print("| jobs | seconds | jobs/s (submit to terminal row) | submit s |")
        print("|---|---|---|---|")
        for n in args.jobs:
            rows = [{"custom_id": f"r{i}", "raw_prompt": "x", "max_tokens": 8} for i in range(n)]
            seconds, _, submit_s = run_queue(services, rows)
            print(f"| {n} | {seconds:.2f} | {n / seconds:.0f} | {submit_s:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
