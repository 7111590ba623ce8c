"""bench/throughput.py end to end on a tiny model: both systems produce the same useful
tokens, and the table, JSON and ratios are there (timings themselves are not asserted)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_throughput_bench_runs_on_a_tiny_model(tiny_model: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", [
        "throughput.py", "--model", str(tiny_model), "--dtype", "float32", "--num-requests",
        "6", "--max-output", "8", "--batch-size", "4", "--workloads", "shared-prefix",
        "long-tail", "--json", str(out), "--no-results-md",
    ])
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "bench" / "throughput.py"), run_name="__main__")
    assert exit_info.value.code == 0
    report = json.loads(out.read_text())
    for entry in report["raw"]:
        ours, base = entry["kvbatch"], entry["transformers"]
        assert ours["useful_tokens"] == base["useful_tokens"] > 0
        assert ours["model_flops"] == base["model_flops"] > 0
        assert 0 < ours["kv_real_bytes"] <= ours["kv_allocated_bytes"]
    shared = next(e for e in report["raw"] if e["workload"] == "shared-prefix")
    assert shared["kvbatch"]["prefix_hit_rate"] > 0.5
    assert "vs transformers" in capsys.readouterr().out


def test_profile_names_the_parts_of_a_step(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [
        "profile.py", "--model", str(tiny_model), "--dtype", "float32", "--workload",
        "shared-prefix", "--num-requests", "4", "--max-output", "6", "--top", "100",
    ])
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "bench" / "profile.py"), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for part in ("matmul", "attention", "python, rest"):
        assert part in out
    assert "kvbatch::paged_decode" in out  # the C kernels are labelled in the profile
    from kernels import native

    lib = native.library("cpu_decode")
    assert type(lib.paged_decode).__name__ != "function"  # the labels were taken off again


def test_gpu_check_lists_its_steps_and_refuses_to_run_without_cuda() -> None:
    import subprocess

    import torch

    dry = subprocess.run(["make", "-s", "gpu-check", "ARGS=--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    steps = [line.split()[0] for line in dry.stdout.splitlines() if "at most" in line]
    assert steps == ["kernel-tests", "engine-tests", "parity", "kernels", "throughput"]
    assert "bench/kernels.py" in dry.stdout and "RESULTS.md" in dry.stdout
    (throughput,) = [line for line in dry.stdout.splitlines() if line.startswith("throughput")]
    assert "--device cuda" in throughput  # transformers on the GPU too, not the host's CPU
    only = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--only",
                           "parity,kernels"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert [line.split()[0] for line in only.stdout.splitlines() if "at most" in line] == [
        "parity", "kernels"]
    wrong = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--only", "paritee"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "no step paritee" in wrong.stderr
    if torch.cuda.is_available():
        return  # the real run is make gpu-check's own business on a GPU machine
    real = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert real.returncode != 0 and "needs a CUDA device" in real.stderr


def test_peer_bench_runs_kvbatchs_half_on_a_tiny_model(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench/peer.py without a llama-server binary: the kvbatch rows, cold and warm, and the
    single-request latency (the llama-server half needs the binary: see its docstring)."""
    monkeypatch.setattr(sys, "argv", ["peer.py", "--model", str(tiny_model), "--dtype",
                                      "float32", "--concurrency", "3", "--out", str(tmp_path)])
    monkeypatch.syspath_prepend(str(REPO))
    runpy.run_path(str(REPO / "bench" / "peer.py"), run_name="__main__")
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("| kvbatch | 3 |")]
    cold, warm = (float(cell) for cell in row.strip("|").split("|")[2:4])
    assert cold > 0 and warm > 0
    assert "single request, 64 tokens: kvbatch" in out
