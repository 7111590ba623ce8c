"""What an ``EngineConfig`` resolves to on this machine (device, dtype, block size), and the
values the engine discovers when it loads the model and sizes the KV pool."""

from __future__ import annotations

import ctypes
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


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Have this process's malloc keep the memory it frees for its next allocations (glibc:
    no block in a mapping of its own, no trimming), as vLLM's CPU backend gets from tcmalloc.

    glibc gives each block of over 32 MB a mapping of its own and unmaps it when freed, so
    every prefill step faulted its large activations in again, a page at a time: on a 2-core
    KVM Xeon, Llama-3.2-1B's 1,721-token prefill step took 4.75 s, 2.85 s with this (the
    fused gate/up projection's 56 MB output: 169 ms a layer, 58 ms into memory kept). The
    process keeps its peak heap for its life instead. On threads other than the main one
    (a worker's ``--no-engine-process`` engine thread), glibc's heaps of 64 MB a thread still
    give a larger block a mapping of its own. False where the C library has no ``mallopt``
    (not glibc), or refused."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


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
