"""The real services every test directory talks to (override with the environment), and
waiting on them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REDIS_URL = os.environ.get("KVBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get(
    "KVBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# Full-size reliability runs (10,000 jobs, soak, more kills and inputs).
SOAK = os.environ.get("KVBATCH_SOAK") == "1"


def wait_until(
    predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"{what} not met within {timeout_s}s")


def all_roles_store():  # type: ignore[no-untyped-def]
    """A test's view of the SQL store with every role's methods on one object (production code
    holds only the role it needs)."""
    from jobs.store import BatchStore, DeliveryStore, JobReader, MaintenanceStore, ProducerStore

    class SQL(ProducerStore, DeliveryStore, MaintenanceStore, BatchStore, JobReader):
        pass

    return SQL


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (a worker's engine process), from /proc."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def thread_workers(tiny_model: str, services: dict[str, str], model: str = "tiny"):  # type: ignore[no-untyped-def]
    """A generator fixture's body: yields ``start(**overrides)``, which runs a worker loop on
    the tiny model in a thread (served as ``model``); every one is stopped (no drain) at the
    end."""
    import threading

    from worker.loop import Worker
    from worker.main import build_engine
    from worker.settings import worker_settings

    started: list[tuple[Worker, threading.Thread]] = []

    def start(**overrides: object) -> Worker:
        values: dict[str, object] = {
            "model": tiny_model, "served_model_name": model, "device": "cpu",
            "num_kv_blocks": 1024, "max_num_seqs": 64, "waiting_buffer": 16,
            "lease_ttl_s": 2.0, "drain_timeout_s": 5.0, "reconcile_interval_s": 60.0,
            "poll_interval_ms": 10, **services, **overrides,
        }
        settings = worker_settings(**values)
        worker = Worker(settings, build_engine(settings))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop(drain=False)
        thread.join(30)


def jsonl(text: str) -> list[Any]:
    """The records of JSON-lines text. Lines end at ``\\n`` only: ``str.splitlines`` would also
    cut at U+2028 or U+0085, which a model's text may hold and JSON leaves unescaped."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]
