"""Paged-KV attention ops and the one place that picks their implementation.

``torch`` is the reference in ``kernels/reference.py`` (eager, the spec); ``cpu`` is the CPU
path (``kernels/cpu.py``: a native C decode kernel, cascade decode, fused SDPA prefill);
``triton`` runs the Triton kernels, cascade decode included (the CUDA path, or the CPU under
``TRITON_INTERPRET=1`` for tests). ``auto`` picks Triton on CUDA and the CPU ops elsewhere;
``KVBATCH_ATTENTION_BACKEND`` overrides the choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import int8, reference
from kernels.lora import LoRASlots

BACKENDS = ("auto", "torch", "cpu", "triton")
BACKEND_ENV = "KVBATCH_ATTENTION_BACKEND"


@dataclass(frozen=True)
class Backend:
    """One attention backend: what the model's layers and the model runner call and ask.

    Built once per engine (``get_ops(resolve_backend(...))``) and handed to both the model and
    the runner. Fields:

    - ``name``: the resolved backend (``torch``, ``cpu`` or ``triton``).
    - ``reshape_and_cache``, ``decode``, ``prefill``: the three ops a paged-attention layer
      calls, with the signatures of ``reference``.
    - ``cascade``: ``decode`` also takes ``prefix=(rows, num_blocks)``, the decode rows that
      share their first blocks (``kernels.cascade.shared_prefix``), and reads those blocks once.
    - ``fused``: the fused C layer ops of ``kernels.native`` (``rms_norm``, ``rotary_``,
      ``silu_mul``) come with it, and greedy sampling takes the C ``argmax``.
    - ``linear``: what the model's linear layers call, with ``F.linear``'s signature.
    - ``linear_int8``: what they call once their weights are int8 (``kernels.int8``):
      ``(x, q, scale, bias)``, the C kernel on the CPU, the Triton one on CUDA.
    - ``lora``: what an adapted projection calls to add its rows' adapter products
      (``kernels.lora``): ``(slots, x, y, mapping)``, ``y`` returned with them added.
    """

    name: str
    reshape_and_cache: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    cascade: bool = False
    fused: bool = False
    linear: Callable[..., torch.Tensor] = F.linear
    linear_int8: Callable[..., torch.Tensor] = int8.linear_reference
    lora: Callable[..., torch.Tensor] = LoRASlots.add


def resolve_backend(requested: str, device: torch.device) -> str:
    """Resolve a requested backend (one of ``BACKENDS``) to the one that runs."""
    choice = os.environ.get(BACKEND_ENV) or requested
    if choice not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return choice


def get_ops(backend: str, batch_invariant: bool = False) -> Backend:
    """The ``Backend`` of a resolved backend name (``torch``, ``cpu`` or ``triton``); with
    ``batch_invariant``, its batch-invariant variant (``kernels.batch_invariant``)."""
    ops = _ops(backend)
    if not batch_invariant:
        return ops
    from kernels.batch_invariant import invariant_ops

    return invariant_ops(ops)


def _ops(backend: str) -> Backend:
    if backend == "torch":
        return Backend(
            name="torch",
            reshape_and_cache=reference.reshape_and_cache,
            decode=reference.paged_attention_decode,
            prefill=reference.paged_attention_prefill,
        )
    if backend == "cpu":
        from kernels import cpu, native
        from kernels.lora import add_lora_cpu

        return Backend(
            name="cpu",
            reshape_and_cache=cpu.reshape_and_cache,
            decode=cpu.paged_attention_decode,
            prefill=cpu.paged_attention_prefill,
            cascade=True,
            fused=True,
            linear=native.linear,
            linear_int8=native.linear_int8,
            lora=add_lora_cpu,
        )
    if backend == "triton":
        # Imported here so that the torch backend never imports triton (nor compiles anything).
        from kernels.int8_triton import linear_int8
        from kernels.paged_decode import paged_attention_decode
        from kernels.paged_prefill import paged_attention_prefill
        from kernels.reshape_and_cache import reshape_and_cache

        return Backend(
            name="triton",
            reshape_and_cache=reshape_and_cache,
            decode=paged_attention_decode,
            prefill=paged_attention_prefill,
            cascade=True,
            linear_int8=linear_int8,
        )
    raise ValueError(f"unknown attention backend {backend!r}")
