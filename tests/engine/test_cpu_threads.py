"""``cpu_threads``: the engine's CPU threads, set by flag or environment on a worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kernels import native


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_engine_runs_on_the_threads_it_is_given(tiny_model: Path, restore_threads: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)
    seen: list[int] = []
    linear = native.linear_rows

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())  # what the C kernels are handed
        return linear(*args, **kwargs)

    monkeypatch.setattr(native, "linear_rows", counted)
    engine = LLMEngine(EngineConfig(model=str(tiny_model), cpu_threads=1, num_kv_blocks=8,
                                    batch_invariant=True))
    assert torch.get_num_threads() == 1
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
    assert seen and set(seen) == {1}


def test_unset_leaves_the_process_default(tiny_model: Path, restore_threads: None) -> None:
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=8))
    assert torch.get_num_threads() == 2


def test_refused_below_one() -> None:
    with pytest.raises(ValueError, match=r"^cpu_threads must be >= 1, got 0$"):
        EngineConfig(cpu_threads=0)


def test_a_worker_takes_it_by_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.settings import engine_config

    monkeypatch.setenv("KVBATCH_CPU_THREADS", "3")
    assert engine_config().cpu_threads == 3
    assert engine_config(cpu_threads=5).cpu_threads == 5
    monkeypatch.delenv("KVBATCH_CPU_THREADS")
    assert engine_config().cpu_threads is None
