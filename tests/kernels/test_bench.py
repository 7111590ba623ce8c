"""``bench/kernels.py --interpret``: the whole benchmark on tiny sizes, results checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_under_the_interpreter_and_checks_results():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "bench/kernels.py", "--interpret", "--iters", "1", "--warmup", "0"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("decode   ") for line in lines) == 4
    assert sum(line.startswith("prefill ") for line in lines) == 4
    assert sum(line.startswith("cache ") for line in lines) == 4
    assert lines[-1] == "all results match the reference"
