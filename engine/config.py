"""Engine configuration (validated once, frozen) and the values discovered at load time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
# KV budget on the CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine.

    Args:
        model: a Hugging Face model directory, or ``smollm2-135m-instruct`` (the built-in default).
        dtype: ``float32``, ``bfloat16`` or ``float16`` for weights, activations and the KV
            cache, or ``auto``: bfloat16 on CUDA (float16 without bf16 support) and on CPUs that
            multiply bf16 natively (AVX512-BF16 or AMX), float32 on other CPUs, where torch's
            bf16 matmul runs about a hundred times slower than float32.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        block_size: tokens per KV block; by default 16 on CUDA (the Triton kernels' tile) and 8
            on the CPU, where the kernels run as fast with either and 8 halves the KV memory
            lost to partly filled last blocks.
        num_kv_blocks: size of the KV block pool; overrides the memory budget when set.
        kv_cache_memory_bytes: KV budget in bytes (default 2 GiB on the CPU).
        gpu_memory_utilization: on CUDA without an explicit budget, the fraction of the device
            memory free after loading the model that the KV pool takes.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one engine step (prefill chunks + decodes).
        max_model_len: longest prompt + output; defaults to the model's context length.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes across requests.
        enable_chunked_prefill: split prompts longer than the step budget over several steps.
        attention_backend: ``auto`` (Triton on CUDA, ``cpu`` elsewhere), ``torch``, ``cpu``
            or ``triton``.
        seed: seed of the engine's global generator (requests may carry their own).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "auto"
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(DTYPES)} or 'auto', got {self.dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None and (
            self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    def resolve_block_size(self, device: torch.device) -> int:
        if self.block_size is not None:
            return self.block_size
        return 16 if device.type == "cuda" else 8

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device")
        return torch.device(self.device)


@dataclass(frozen=True)
class RuntimeInfo:
    """Values the engine discovers when it loads the model and sizes the KV pool."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
