"""In-thread workers for the queue tests (imported by tests/jobs/conftest.py and tests)."""

from __future__ import annotations

import time

from services import REDIS_URL

from jobs.constants import Keys
from jobs.schemas import JobSpec

TINY_MODEL_NAME = "tiny"


class RunningWorker:
    """A worker running its loop in a thread of the test process."""

    def __init__(self, worker) -> None:  # type: ignore[no-untyped-def]
        import threading

        self.worker = worker
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.rc = self.worker.run()

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> int | None:
        self.worker.stop(drain=drain)
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "worker did not stop"
        return self.rc


def worker_settings(tiny_model: str, keys: Keys, database_url: str, **overrides):  # type: ignore[no-untyped-def]
    from worker.settings import worker_settings as settings

    values = {
        "model": tiny_model, "served_model_name": TINY_MODEL_NAME, "redis_url": REDIS_URL,
        "database_url": database_url, "key_prefix": keys.prefix, "device": "cpu",
        "num_kv_blocks": 512, "max_num_seqs": 16, "waiting_buffer": 4, "lease_ttl_s": 1.5,
        "drain_timeout_s": 5.0, "reconcile_interval_s": 60.0, "reconcile_grace_s": 0.0,
        "poll_interval_ms": 10,
    }
    values.update(overrides)
    return settings(**values)


def long_job(i: int, max_tokens: int) -> JobSpec:
    """A greedy job of the tiny model that generates exactly ``max_tokens`` tokens."""
    return JobSpec(model=TINY_MODEL_NAME, prompt=f"job {i}",
                   sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})


def bare_worker(tiny_model: str, keys: Keys, pg_url: str, pg_engine, redis_client,  # type: ignore[no-untyped-def]
                **overrides):
    """A Worker whose loop and engine thread are not started: its parts are driven by hand."""
    from worker.loop import Worker

    settings = worker_settings(tiny_model, keys, pg_url, **overrides)
    return Worker(settings, llm=None, redis_client=redis_client, db=pg_engine)


def paced(engine):  # type: ignore[no-untyped-def]
    """The engine, 5 ms a step at least: a 1,900-token job takes 9.5 s or more, so a test that
    stops, cancels or expires it mid-way gets there first, and one that needs it to outlast a
    lease gets that, however fast the machine is (unpaced, a fast engine finished one inside a
    1 s deadline)."""
    step = engine.step

    def paced_step():  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return step()

    engine.step = paced_step
    return engine
