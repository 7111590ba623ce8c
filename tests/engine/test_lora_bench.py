"""bench/lora.py end to end on a tiny model: every mode runs its rounds and the table compares
each to the base (timings themselves are not asserted)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_lora_bench_runs_on_a_tiny_model(tiny_model: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(sys, "argv", [
        "lora.py", "--model", str(tiny_model), "--batch", "4", "--prompt-len", "10",
        "--max-tokens", "3", "--repeats", "1", "--rank", "8", "--clock", "cpu",
        "--results-md", str(results)])
    monkeypatch.syspath_prepend(str(REPO))
    runpy.run_path(str(REPO / "bench" / "lora.py"), run_name="__main__")
    out = capsys.readouterr().out
    # One round per mode: one prefill step (the 4 prompts fit the budget), then 2 decodes.
    for mode in ("base", "mixed", "one-adapter"):
        assert f"{mode}: prefill " in out and " in 1 steps, decode " in out
        assert re.search(rf"^\| {mode} \| [\d.]+ \| \d+ \| [\d.]+x \| [\d.]+ \| \d+ \| [\d.]+x \|$",
                         out, flags=re.M), mode
    assert re.search(r"^\| base \| [\d.]+ \| \d+ \| 1\.00x \| [\d.]+ \| \d+ \| 1\.00x \|$", out,
                     flags=re.M)
    assert "three adapters of rank 8" in out and "mixed: 1 rows on the base" in out
    assert "| rows | prefill CPU ms/step |" in results.read_text()
