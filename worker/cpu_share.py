"""Workers that share one host's CPU cores split them between their engines.

A CPU engine takes every core its process may run on (torch's default). Two such workers on
one host then run twice as many threads as there are cores, and OpenMP's threads spin while
they wait for each other: 3,000 tiny-model jobs through two workers on a 2-core host took
51.9 s with each engine in its own process against 12.5 s with the cores split
(``bench/queue_path.py --mode workers``, bench/RESULTS.md). So a worker whose engine is free to
share (:attr:`~worker.engine_thread.EngineRunner.host_cpus`: on the CPU, ``cpu_threads``
unset, the process not pinned) names its host in its heartbeat, and every few seconds gives
its engine its share of the host's cores among the live workers that name the same host
(a ``Threads`` command): the split follows workers as they join and leave.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import redis

from jobs.constants import Keys
from jobs.queue import live_cpu_peers

log = logging.getLogger(__name__)

SHARE_INTERVAL_S = 2.0


def threads_for(worker_id: str, peers: Sequence[str], cpus: int) -> int:
    """``worker_id``'s threads when the workers ``peers`` (itself counted whether or not it is
    among them) split ``cpus`` cores: ``cpus // n`` each, one more for the first ``cpus % n``
    in id order, and at least 1."""
    ordered = sorted(set(peers) | {worker_id})
    n = len(ordered)
    return max(1, cpus // n + (ordered.index(worker_id) < cpus % n))


class CpuShare:
    """This worker's share of its host's cores, looked up at most every
    :data:`SHARE_INTERVAL_S` (``update``); ``host`` is what the heartbeat announces."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, cpus: int,
                 host: str | None = None) -> None:
        self.client, self.keys, self.worker_id, self.cpus = client, keys, worker_id, cpus
        self.host = host or socket.gethostname()
        self.threads = cpus  # its share: every core until others show up
        self._next = 0.0

    def update(self, now: float, running: int) -> int | None:
        """The engine's share of the cores where it runs on another count (``running``, from
        its stats: whatever it started with), else None."""
        if now < self._next:
            return None
        self._next = now + SHARE_INTERVAL_S
        peers = live_cpu_peers(self.client, self.keys, self.host)
        threads = threads_for(self.worker_id, peers, self.cpus)
        if threads != self.threads:
            log.info("%d workers share the %d cores of %s: %d engine threads (was %d)",
                     len(set(peers) | {self.worker_id}), self.cpus, self.host, threads,
                     self.threads)
            self.threads = threads
        return None if threads == running else threads
