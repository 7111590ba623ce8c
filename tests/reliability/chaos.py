"""The reliability suite's harness: worker processes that can be killed, stopped, resumed and
terminated, a Redis server that can be restarted empty, and the exactly-once audit."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from services import child_pids, wait_until

from jobs.constants import Keys

REPO = Path(__file__).resolve().parents[2]
PROBED_WORKER = Path(__file__).with_name("probed_worker.py")
MODEL = "tiny"


def free_port(start: int = 6390) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


class RedisServer:
    """``redis-server`` on a spare port, owned by one test. Keeps nothing on disk."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir)]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._up, 10, what="redis-server up")

    def _up(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart_empty(self, down_s: float = 0.5) -> None:
        """SIGKILL and start again: everything in it is gone."""
        self.stop()
        time.sleep(down_s)
        self.start()
        self.restarts += 1


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    rss_kib: list[int] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def rss(self) -> int:
        """Resident memory in KiB of the worker and its engine process (0 once gone)."""
        return sum(_rss(pid) for pid in (self.proc.pid, *child_pids(self.proc.pid)))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class WorkerProcs:
    def __init__(self, tiny_model: str, keys: Keys, redis_url: str, database_url: str,
                 log_dir: Path) -> None:
        self.tiny_model, self.keys = tiny_model, keys
        self.redis_url, self.database_url = redis_url, database_url
        self.log_dir = log_dir
        self.procs: list[WorkerProc] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *, probes: Sequence[str] = (),
              **settings: object) -> WorkerProc:
        """Start ``python -m worker`` with the suite's defaults overridden by ``settings``;
        with ``probes`` (flags of ``probed_worker.py``), that script instead."""
        values: dict[str, object] = {
            "model": self.tiny_model, "served_model_name": MODEL, "redis_url": self.redis_url,
            "database_url": self.database_url, "key_prefix": self.keys.prefix,
            "worker_id": name, "device": "cpu", "num_kv_blocks": 512, "max_num_seqs": 16,
            "waiting_buffer": 4, "lease_ttl_s": 1.5, "drain_timeout_s": 5.0,
            "reconcile_interval_s": 2.0, "reconcile_grace_s": 2.0, "max_deliveries": 50,
        }
        values.update(settings)
        cmd = [sys.executable, *([str(PROBED_WORKER), *probes] if probes else ["-m", "worker"])]
        for key, value in values.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        log_path = self.log_dir / f"{name}-{len(self.procs)}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        worker = WorkerProc(name, proc, log_path)
        self.procs.append(worker)
        return worker

    def kill_all(self) -> None:
        for w in self.procs:
            if w.alive():
                w.signal(signal.SIGCONT)
                w.proc.kill()
                w.proc.wait(10)


@dataclass(frozen=True)
class Audit:
    jobs: int
    terminal: int
    metrics_rows: int
    duplicate_terminal_rows: int
    lost: int
    by_status: dict[str, int]


def audit(engine: sa.Engine, job_ids: list[str]) -> Audit:
    """Every job of ``job_ids`` must be terminal with exactly one ``job_metrics`` row."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT j.status, count(m.job_id) AS n FROM jobs j "
            "LEFT JOIN job_metrics m ON m.job_id = j.id GROUP BY j.id, j.status")).all()
        total_metrics = conn.execute(sa.text("SELECT count(*) FROM job_metrics")).scalar_one()
        distinct = conn.execute(sa.text(
            "SELECT count(DISTINCT job_id) FROM job_metrics")).scalar_one()
    by_status: dict[str, int] = {}
    for status, _ in rows:
        by_status[status] = by_status.get(status, 0) + 1
    terminal = sum(1 for s, n in rows if s not in ("queued", "running") and n == 1)
    return Audit(jobs=len(rows), terminal=terminal, metrics_rows=total_metrics,
                 duplicate_terminal_rows=total_metrics - distinct,
                 lost=len(job_ids) - terminal, by_status=by_status)


def random_moments(rng: random.Random, n: int, low_s: float, high_s: float) -> list[float]:
    return [rng.uniform(low_s, high_s) for _ in range(n)]


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
