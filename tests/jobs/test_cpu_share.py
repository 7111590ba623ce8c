"""CPU workers on one host split its cores (``worker.cpu_share``): the arithmetic, the peers
the heartbeats announce, and two real workers whose engines end up on their shares."""

from __future__ import annotations

import os

import pytest
import redis
import torch

from engine.config import EngineConfig
from engine.runtime import shared_host_cpus
from jobs.constants import Keys
from jobs.queue import JobQueue, live_cpu_peers
from worker.cpu_share import SHARE_INTERVAL_S, CpuShare, threads_for

UNPINNED = len(os.sched_getaffinity(0)) == os.cpu_count()


def test_the_cores_are_split_in_id_order() -> None:
    assert threads_for("a", ["a"], 16) == 16
    assert [threads_for(w, ["c", "a", "b"], 16) for w in "abc"] == [6, 5, 5]
    assert threads_for("b", ["a"], 16) == 8  # itself counted before its heartbeat shows
    assert threads_for("a", ["a", "a", "b"], 7) == 4 and threads_for("b", ["a", "b"], 7) == 3
    assert [threads_for(w, ["a", "b", "c"], 2) for w in "abc"] == [1, 1, 1]  # at least one


def test_only_an_unpinned_cpu_engine_without_cpu_threads_is_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = os.cpu_count() or 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    cpu = torch.device("cpu")
    assert shared_host_cpus(EngineConfig(model="m"), cpu) == cpus
    assert shared_host_cpus(EngineConfig(model="m", cpu_threads=cpus), cpu) == 0
    assert shared_host_cpus(EngineConfig(model="m"), torch.device("cuda")) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus - 1)))
    assert shared_host_cpus(EngineConfig(model="m"), cpu) == 0  # pinned by its operator


def test_peers_are_the_live_workers_naming_the_host(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    for worker, host in (("w2", "h1"), ("w1", "h1"), ("w3", "h2"), ("w4", None)):
        q.heartbeat(worker, 60_000, cpu_host=host)
    assert live_cpu_peers(redis_client, keys, "h1") == ["w1", "w2"]
    assert live_cpu_peers(redis_client, keys, "h2") == ["w3"]
    redis_client.delete(keys.heartbeat("w2"))  # w2 died
    assert live_cpu_peers(redis_client, keys, "h1") == ["w1"]


def test_the_share_changes_as_workers_join_and_leave(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    share = CpuShare(redis_client, keys, "w1", 8, host="h")
    q.heartbeat("w1", 60_000, cpu_host="h")
    assert share.update(100.0, running=8) is None and share.threads == 8  # alone: every core
    q.heartbeat("w2", 60_000, cpu_host="h")
    assert share.update(100.0 + SHARE_INTERVAL_S / 2, 8) is None  # looked up at most so often
    assert share.update(100.0 + SHARE_INTERVAL_S, 8) == 4 and share.threads == 4
    assert share.update(100.0 + 2 * SHARE_INTERVAL_S, 4) is None  # the engine has its share
    assert share.update(100.0 + 3 * SHARE_INTERVAL_S, 8) == 4  # not yet (or not as it began)
    q.drop_heartbeat("w2")
    assert share.update(100.0 + 4 * SHARE_INTERVAL_S, 4) == 8


@pytest.mark.skipif(not UNPINNED or (os.cpu_count() or 1) < 2,
                    reason="needs an unpinned process and two cores to split")
def test_two_workers_on_one_host_split_its_cores(start_worker, wait_for) -> None:  # type: ignore[no-untyped-def]
    cpus = os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(cpus)  # the engines start on every core, whatever an earlier test
    try:                         # left (an engine that starts on fewer: the test above)
        first, second = start_worker(), start_worker()
        ids = [first.worker.worker_id, second.worker.worker_id]

        def threads(running) -> int | None:  # type: ignore[no-untyped-def]
            stats = running.worker.engine_stats  # the engine's idle stats, once a second
            return None if stats is None else stats.cpu_threads

        for running in (first, second):
            assert running.worker.runner.host_cpus == cpus
            wait_for(lambda r=running: threads(r) == threads_for(r.worker.worker_id, ids, cpus),
                     timeout_s=30)
        second.stop(drain=False)  # its heartbeat goes: the first takes every core again
        wait_for(lambda: threads(first) == cpus, timeout_s=30)
        gauge = first.worker.metrics.registry.get_sample_value(
            "kvbatch_engine_cpu_threads", {"model_name": "tiny"})
        assert gauge == cpus
    finally:
        torch.set_num_threads(before)  # MKL's count is process-wide
