"""``bench/kernels.py --interpret``: the whole benchmark on tiny sizes, results checked."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Under the interpreter with the machine's CUDA tensors Triton 3.6 fails before any kernel; on a
# GPU machine `make gpu-check` runs the whole benchmark compiled, every result checked.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the compiled benchmark runs in make gpu-check")

REPO_ROOT = Path(__file__).resolve().parents[2]
HEADER = (REPO_ROOT / "bench" / "RESULTS.md").read_text().splitlines(keepends=True)[:4]
NUMBER = r"(\d+(?:\.\d+)?)"


def run_bench(results: Path) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = ["bench/kernels.py", "--interpret", "--results", str(results)]
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def figures(line: str, unit: str) -> list[float]:
    return [float(x) for x in re.findall(NUMBER + " " + unit, line)]


def test_bench_checks_every_result_and_appends_its_table(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("".join(HEADER))
    lines = run_bench(results)
    table = lines[: lines.index(f"appended to {results}")]

    assert any(line.startswith("checked bf16, fp16, fp32 decode") for line in table)
    assert any(line.startswith("checked a pool of") for line in table)
    decode = [line for line in table if line.startswith("decode   ")]
    prefill = [line for line in table if line.startswith("prefill  ")]
    cache = [line for line in table if line.startswith("cache    ")]
    cascade = [line for line in table if line.startswith("cascade  ")]
    assert len(decode) == len(prefill) == len(cache) == 4 and len(cascade) == 2
    for line in decode + prefill + cache + cascade:
        times = figures(line, "us")
        assert len(times) >= 2 and all(t > 0 and math.isfinite(t) for t in times), line
    for line in decode + cascade:
        assert len(figures(line, "GB/s")) == 2, line  # triton and sdpa / plain, both measured

    verdict = re.fullmatch(
        rf"decode at contexts >= \d+: worst {NUMBER}% of copy bandwidth, (meets|misses) the "
        r"70% target \(interpreter: not a GPU measurement\)",
        table[-2],
    )
    assert verdict, table[-2]
    assert (float(verdict[1]) >= 70) == (verdict[2] == "meets")
    checks = re.fullmatch(r"all (\d+) checks match the reference", table[-1])
    # 3 dtypes x (2 decode + 1 prefill) on one layout, 5 on the large pool, 2 per decode case,
    # 2 per cascade case, 1 or 2 per prefill case (SDPA where nothing is cached), 2 per cache
    # case.
    assert checks and int(checks[1]) == 9 + 5 + 2 * 4 + 2 * 2 + (4 + 2) + 2 * 4, table[-1]

    text = results.read_text()
    assert text.startswith("".join(HEADER))  # the file's first lines are kept
    section = text[len("".join(HEADER)) :]
    assert re.match(
        r"\n### \d{4}-\d\d-\d\d \d\d:\d\d UTC — kernels \(bf16, interpreter\)\n", section
    )
    assert "`python bench/kernels.py --interpret --results " in section
    assert "\n```\n" + "\n".join(table) + "\n```\n" in section
