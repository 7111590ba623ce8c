"""The real services every test directory talks to (override with the environment), and
waiting on them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
