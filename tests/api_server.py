"""A ``kvbatch serve`` process on 127.0.0.1 (a real uvicorn server) for the API tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """``kvbatch serve`` with the given services; ``start`` waits for ``/health``."""

    def __init__(self, services: dict[str, str], files_dir: Path, log: Path,
                 models: tuple[str, ...] = ("tiny",), **settings: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.args = [sys.executable, "-m", "worker.cli", "serve", "--port", str(self.port),
                     "--files-dir", str(files_dir), "--redis-url", services["redis_url"],
                     "--database-url", services["database_url"],
                     "--key-prefix", services["key_prefix"],
                     *(a for m in models for a in ("--model", m))]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVBATCH_API_POLL_INTERVAL_S": "0.2",
                    **{f"KVBATCH_API_{k.upper()}": str(v) for k, v in settings.items()}}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> ApiServer:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvbatch serve exited: {self.log.read_text()}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"kvbatch serve did not answer: {self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
