"""What an ``EngineConfig`` resolves to on this machine (device, dtype, block size), and the
values the engine discovers when it loads the model and sizes the KV pool."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from kernels.native import cpu_has_native_bf16


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(config.device)


def shared_host_cpus(config: EngineConfig, device: torch.device) -> int:
    """The host's CPU count where an engine's threads are free to share that host with other
    workers' engines (it runs on the CPU, ``cpu_threads`` is unset and nothing pinned the
    process to fewer CPUs than the host has), else 0: the split is then the operator's."""
    cpus = os.cpu_count() or 1
    pinned = len(os.sched_getaffinity(0)) < cpus
    return cpus if device.type == "cpu" and config.cpu_threads is None and not pinned else 0


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_block_size(config: EngineConfig, device: torch.device) -> int:
    if config.block_size is not None:
        return config.block_size
    return 16 if device.type == "cuda" else 8


@dataclass(frozen=True)
class RuntimeInfo:
    """Values the engine discovers when it loads the model and sizes the KV pool."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int  # host pool for swap preemption (0: preemption recomputes)
    kv_bytes_per_block: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
