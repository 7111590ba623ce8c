"""KV pool sizing: the budget arithmetic, the profiling step (device-agnostic, run here on the
CPU) and, on a CUDA machine (``make gpu-check``), the profiled pool itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.config import DEFAULT_CPU_KV_BYTES
from engine.memory import GiB, kv_budget, kv_budget_bytes, profile_step


def test_budget_is_the_utilized_share_less_what_is_in_use_and_the_step_peak() -> None:
    assert kv_budget_bytes(80 * GiB, 20 * GiB, 2 * GiB, 0.9) == 50 * GiB
    assert kv_budget_bytes(80 * GiB, 0, 0, 0.5) == 40 * GiB


def test_no_room_left_is_one_line_naming_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        kv_budget_bytes(16 * GiB, 7 * GiB, 2 * GiB, 0.5)
    message = str(err.value)
    assert "\n" not in message and "0.5 of 16.0 GiB" in message
    assert "7.00 GiB in use" in message and "2.00 GiB for the largest step" in message
    assert "raise gpu_memory_utilization" in message


@pytest.mark.parametrize(("num_tokens", "max_num_seqs"), [(100, 8), (5, 8), (37, 37)])
def test_profile_step_runs_the_full_budget_over_every_seat(
    tiny_model: Path, num_tokens: int, max_num_seqs: int
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=4))
    model, backend = engine.runner.model, engine.runner.backend
    rows = profile_step(model, backend, engine.info.block_size, num_tokens, max_num_seqs, 0)
    assert rows == min(num_tokens, max_num_seqs)


def test_cpu_budget_is_the_configured_bytes(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=4))
    model, backend, bs = engine.runner.model, engine.runner.backend, engine.info.block_size
    assert kv_budget(EngineConfig(device="cpu"), model, backend, bs) == DEFAULT_CPU_KV_BYTES
    assert kv_budget(EngineConfig(device="cpu", kv_cache_memory_bytes=12345), model, backend,
                     bs) == 12345


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device (make gpu-check)")
def test_cuda_pool_fills_the_utilized_share(tiny_model: Path) -> None:
    utilization = 0.3
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cuda",
                                    gpu_memory_utilization=utilization))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use = total - free  # weights, pool, context, other processes
    pool = engine.info.num_kv_blocks * engine.info.kv_bytes_per_block
    assert pool > 0.1 * total
    assert in_use <= utilization * total + 256 * 2**20
