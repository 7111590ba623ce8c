"""A CPU engine's process keeps the memory it frees for its next steps (``keep_freed_memory``):
a large block freed and asked for again is not faulted in again, page by page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Page faults while each of nine fresh 64 MB tensors (past glibc's largest mmap threshold,
# 32 MB) is written and freed: before and after a CPU engine is built. The median: the heap's
# holes can fall a few bytes short of an aligned block's ask, so the first one or two after
# the engine's own allocations may still grow the heap (once), and the rest reuse it.
_FAULTS = """
import resource, statistics, sys
import torch
from engine import EngineConfig, LLMEngine

def refaults() -> int:
    faults = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 << 20, dtype=torch.uint8)  # allocated, written, freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return int(statistics.median(faults))

plain = refaults()
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=8))
print(plain, refaults())
"""


def test_a_cpu_engine_reuses_freed_blocks_without_faulting_them_in(tiny_model: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(tiny_model)], cwd=REPO,
                         check=True, capture_output=True, text=True).stdout.split()
    plain, kept = (int(x) for x in out[-2:])
    if plain < 1024:  # 16,384 pages of 4 KiB; 32 where the kernel backs them with huge pages
        pytest.skip(f"{plain} faults for 64 MB: huge pages leave too few to compare")
    assert kept * 20 < plain, (plain, kept)


def test_keep_freed_memory_reports_glibc() -> None:
    script = "from engine.runtime import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == "True"  # these machines run glibc, which takes both settings
