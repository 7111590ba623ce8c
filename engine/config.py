"""Engine configuration: validated once, frozen, torch-free.

The worker's settings and ``kvbatch --help`` derive their flags from :class:`EngineConfig`
without loading torch; what the configuration resolves to on a machine (device, dtype, block
size) and the values discovered at load time are in ``engine.runtime``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.lora_config import parse_lora_flags

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "int8")  # EngineConfig.quantization's Literal
# KV budget on the CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_BYTES = 2 * 1024**3
# Host pool for swapped-out KV blocks on CUDA when swap_space_bytes is not given (vLLM's 4 GiB).
DEFAULT_CUDA_SWAP_BYTES = 4 * 1024**3


def _field(default: Any, help: str) -> Any:
    # The help text is the field's documentation: `kvbatch worker --help` shows it.
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine. Every field is documented by its ``help`` metadata (what
    ``kvbatch worker --help`` prints) and can be set on a worker by flag or environment."""

    model: str = _field(DEFAULT_MODEL, "a Hugging Face model directory, or "
                        f"{DEFAULT_MODEL} (the built-in default)")
    dtype: str = _field(
        "float32", "float32, bfloat16 or float16 for weights, activations and the KV cache, "
        "or auto: bfloat16 on CUDA (float16 without bf16 support) and on CPUs that multiply "
        "bf16 natively (AVX512-BF16 or AMX), float32 on other CPUs (there bfloat16 halves "
        "the bytes a decode step reads, since the CPU kernels widen bf16 weights as they "
        "read them, but larger batches pay to widen them for float32 GEMMs)")
    device: str = _field("auto", "cpu, cuda or auto (CUDA when available)")
    block_size: int | None = _field(
        None, "tokens per KV block; by default 16 on CUDA (the Triton kernels' tile) and 8 on "
        "the CPU, where the kernels run as fast with either and 8 halves the KV memory lost "
        "to partly filled last blocks")
    num_kv_blocks: int | None = _field(
        None, "size of the KV block pool; overrides the memory budget when set")
    kv_cache_memory_bytes: int | None = _field(
        None, "KV budget in bytes (default 2 GiB on the CPU)")
    swap_space_bytes: int | None = _field(
        None, "host memory for the KV blocks of preempted sequences (swap preemption); a "
        "preempted sequence is swapped out while this pool has room and recomputed "
        "otherwise. Default 4 GiB of pinned memory on CUDA, 0 (always recompute) on the "
        "CPU, where the host pool would only be a second, slower KV pool")
    gpu_memory_utilization: float = _field(
        0.9, "on CUDA without an explicit budget, the fraction of the device's total memory "
        "this engine may use: the KV pool takes what is left of it after the weights, the "
        "memory already in use and the peak activations of a profiling step at "
        "max_num_batched_tokens")
    max_num_seqs: int = _field(256, "most sequences running at once")
    max_num_batched_tokens: int = _field(
        2048, "token budget of one engine step (prefill chunks + decodes)")
    max_model_len: int | None = _field(
        None, "longest prompt + output; defaults to the model's context length")
    enable_prefix_caching: bool = _field(
        True, "reuse KV blocks of identical prompt prefixes across requests")
    enable_chunked_prefill: bool = _field(
        True, "split prompts longer than the step budget over several steps")
    enforce_eager: bool = _field(
        False, "run every step eagerly; by default a CUDA worker replays decode steps from "
        "CUDA graphs, one per batch size 1, 2, 4, 8, 16, ... up to max_num_seqs, each "
        "captured when first needed (outputs are the same either way)")
    attention_backend: str = _field(
        "auto", "auto (Triton on CUDA, cpu elsewhere), torch, cpu or triton")
    batch_invariant: bool = _field(
        False, "make each job's tokens independent of what else shares its steps (as vLLM's "
        "VLLM_BATCH_INVARIANT), bf16 included, so a re-run dataset reproduces row for row: "
        "every linear and attention row is reduced in one fixed order whatever the batch "
        "(kernels.batch_invariant), without cascade attention. Sampled jobs reproduce when "
        "they carry a seed. Costs speed: see bench/batch_invariant.py")
    quantization: Literal[None, "int8"] = _field(
        None, "int8: weight-only int8 for the attention and MLP projections and the lm_head "
        "(symmetric, a float32 scale per output channel; embeddings and norms as they are, "
        "tied embeddings get an int8 copy for the lm_head), "
        "quantized as a bf16/float32 checkpoint loads (GGUF Q8_0 tensors load as they are, a "
        "scale per 32 inputs). A decode step reads half the bytes of bf16; see "
        "bench/int8.py for speed and quality")
    cpu_threads: int | None = _field(
        None, "threads of the engine's CPU kernels and torch's CPU ops; default: the CPUs this "
        "process may run on (its affinity: taskset, a container's cpuset), which a worker "
        "that may run on every core splits with the other CPU workers of its host (2 workers "
        "on 16 cores: 8 each; worker/cpu_share.py). Set, it is not split")
    pack_cpu_weights: bool = _field(
        True, "where the CPU kernels have AVX512-BF16's dot product and no AMX, pack the bf16 "
        "projections (and the lm_head, the tied table too) once loaded for a C linear that "
        "takes every row count "
        "(kernels.native.pack_bf16: decode steps 1.25-1.29x faster at 8-24 rows, 1.04-1.10x at "
        "32-96, on a Zen 4 EPYC; the same bits as the unpacked kernel from 32 rows); off: the "
        "weights as the checkpoint has them")
    seed: int = _field(0, "seed of the engine's global generator (requests may carry their own)")
    grammar_compile_timeout_s: float = _field(
        30.0, "most seconds one response_format may take to compile (in a process beside the "
        "engine's loop); a format over it fails its job alone")
    grammar_compile_memory_bytes: int = _field(
        2 << 30, "most memory one response_format's compile may take; a format over it fails "
        "its job alone")
    lora: tuple[str, ...] = _field(
        (), "LoRA adapters served beside the base model, NAME=DIR each (PEFT's "
        "adapter_config.json and adapter_model.safetensors; repeatable): a job names one as its "
        "model, NAME or <served model>:NAME, and runs with it in the same steps as the others")
    lora_memory_bytes: int = _field(
        1 << 30, "device memory for resident LoRA adapters: past it the least recently used "
        "adapter no running job holds is unloaded (and loaded again when a job needs it)")

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype must be one of {sorted(DTYPE_NAMES)} or 'auto', got {self.dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.swap_space_bytes is not None and self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0, "
                             f"got {self.grammar_compile_timeout_s}")
        if self.grammar_compile_memory_bytes < 1:
            raise ValueError("grammar_compile_memory_bytes must be >= 1, "
                             f"got {self.grammar_compile_memory_bytes}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        parse_lora_flags(self.lora)
        if self.lora_memory_bytes < 1:
            raise ValueError(f"lora_memory_bytes must be >= 1, got {self.lora_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None and (
            self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
