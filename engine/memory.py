"""How big the KV pools are: a byte budget, or on CUDA what a profiling step leaves (vLLM's way).

On CUDA, after the weights are loaded, the engine runs the largest step the scheduler can make
(:func:`profile_step`) and measures its peak activation memory. The pool then takes

    gpu_memory_utilization * total memory - memory in use (weights, CUDA context, other
    processes) - activation peak

so that no later step can run out of memory. On the CPU the budget is a fixed number of bytes.
"""

from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_BYTES, DEFAULT_CUDA_SWAP_BYTES, EngineConfig
from engine.kv_cache import cdiv
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from kernels import Backend

GiB = 2**30


def kv_budget_bytes(total: int, in_use: int, activation_peak: int, utilization: float) -> int:
    """The KV pool's share of a device of ``total`` bytes, ``in_use`` of them taken (weights,
    context, other processes), with room kept for a step's ``activation_peak``.

    Raises:
        ValueError: nothing is left for the KV pool (one line naming the figures and the fix).
    """
    budget = int(total * utilization) - in_use - activation_peak
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the KV cache: gpu_memory_utilization {utilization} of "
            f"{total / GiB:.1f} GiB, {in_use / GiB:.2f} GiB in use (weights, CUDA context, "
            f"other processes), {activation_peak / GiB:.2f} GiB for the largest step; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget


def kv_budget(config: EngineConfig, model: LlamaForCausalLM, backend: Backend,
              block_size: int) -> int:
    """Bytes for the device KV pool when ``num_kv_blocks`` is not given."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    device = model.embed_tokens.weight.device
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    profile_step(model, backend, block_size, config.max_num_batched_tokens,
                 config.max_num_seqs, config.seed)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_budget_bytes(total, total - free, activation_peak, config.gpu_memory_utilization)


def swap_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the host pool of swap preemption."""
    if config.swap_space_bytes is not None:
        return config.swap_space_bytes
    return DEFAULT_CUDA_SWAP_BYTES if device.type == "cuda" else 0


@torch.inference_mode()
def profile_step(model: LlamaForCausalLM, backend: Backend, block_size: int, num_tokens: int,
                 max_num_seqs: int, seed: int) -> int:
    """Run the step with the largest activations: ``num_tokens`` prompt tokens spread over as
    many sequences as may run (each sampled, with top-k/top-p and logprobs: the sampler's
    largest work), on a KV pool just large enough. Returns how many rows were sampled."""
    num_seqs = min(max_num_seqs, num_tokens)
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20, max_tokens=1)
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence(request_id=f"profile-{i}", prompt_token_ids=[0] * n, params=params,
                       metrics=RequestMetrics(arrival_time=0.0))
        seq.block_table = list(range(next_block, next_block + cdiv(n, block_size)))
        next_block += len(seq.block_table)
        scheduled.append(ScheduledSeq(seq, 0, n, sample=True))
    scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, as the scheduler does
    weight = model.norm.weight  # the model's dtype and device (a packed or int8 weight's is not)
    kv_caches = torch.zeros(
        (model.num_layers, 2, next_block, block_size, model.num_kv_heads, model.head_dim),
        dtype=weight.dtype, device=weight.device,
    )
    runner = ModelRunner(model, backend, kv_caches, block_size, frozenset(), seed)
    out = SchedulerOutput(
        seqs=tuple(scheduled), num_decodes=sum(1 for s in scheduled if s.num_new_tokens == 1),
        block_copies=(), num_batched_tokens=num_tokens,
    )
    return len(runner.run(out).sampled)
