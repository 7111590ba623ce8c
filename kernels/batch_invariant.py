"""The batch-invariant mode's ops (``EngineConfig.batch_invariant``): a row's result is the
same whatever else shares its step, bit for bit, in bf16 too.

A reduction gives different bits when its order changes, and the default ops change it with
the batch: the CPU linear takes a C kernel up to a few rows and torch's GEMM past them (their
orders differ); the CPU decode kernel cuts a row's blocks into runs merged after when it has
fewer rows than threads (a lone request); the Triton decode kernel picks its split-K from the
number of sequences and the longest context; cascade attention starts rows that share a
prefix from one attention over it; prefill attention runs per chunk, and a chunk's bounds
depend on the step's token budget and on what else is scheduled. So here:

- ``linear``: one kernel for every row count, each output reduced in an order fixed by K
  alone: the C kernel (``kernels.native.linear_rows``) on the CPU, a Triton matmul with
  fixed tiles and no split-K (``kernels.invariant_matmul``) on CUDA.
- attention: decode rows read their context whole, in block order, in one task (no split-K);
  a prefill token is a decode row whose context ends at itself (its K/V are written first),
  so a token's attention is the same in any chunk of any step, and the same as if it were
  decoded; no cascade.
- LoRA adapters' products: on the CPU, the C kernel (``kernels.lora.add_lora_fixed``) for
  every row count (a row's product there is the same whatever the other rows; by default
  torch's matmuls take steps of more rows); on CUDA, the Triton kernel runs a program per row
  already.

Everything else a row goes through is per row or elementwise already: RMSNorm (the C kernel
reduces each row alone, in a fixed order of partial sums; torch's per-row reduction on
CUDA), RoPE, SiLU, the embedding, the greedy argmax, and sampling with a request's own seed
(rows without one draw from the engine's generator, in batch order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kernels import Backend, native
from kernels.lora import add_lora_fixed

DecodeOp = Callable[..., torch.Tensor]


def _cpu_decode(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D] in the query's dtype
    if query.shape[0] == 0:
        return torch.empty_like(query)
    out, _ = native.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 split_kv=False)
    return out.to(query.dtype)


def _triton_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    from kernels.paged_decode import paged_attention_decode

    return paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                  num_splits=1)


def prefill_as_decode(decode: DecodeOp) -> DecodeOp:
    """A varlen prefill op (``reference.paged_attention_prefill``'s signature) that runs each
    query token as a row of ``decode``: the token's sequence's block table, its context the
    positions up to its own (causal, the chunk's K/V already in the cache)."""

    def prefill(
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks]
        query_start_loc: torch.Tensor,  # [B + 1]
        seq_lens: torch.Tensor,  # [B], each sequence's context after its chunk
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        num_tokens = query.shape[0]
        starts = query_start_loc.to(torch.int64)
        q_lens = starts[1:] - starts[:-1]  # [B]
        # output_size: no device sync to learn the length on CUDA
        seq_of = torch.repeat_interleave(
            torch.arange(len(q_lens), device=query.device), q_lens, output_size=num_tokens)
        token = torch.arange(num_tokens, device=query.device)
        # a token's context: the tokens before its chunk, then its chunk up to itself
        lens = seq_lens.to(torch.int64)[seq_of] - q_lens[seq_of] + (token - starts[seq_of]) + 1
        return decode(query, key_cache, value_cache, block_tables[seq_of],
                      lens.to(torch.int32), scale)

    return prefill


def invariant_ops(backend: Backend) -> Backend:
    """``backend`` with the batch-invariant linear, attention and LoRA products (see the
    module's docstring).

    The ``cpu`` backend's linear is the C kernel for every row count (float32 or bf16
    weights, and int8 ones); the ``triton`` backend's, the fixed-tile Triton matmul (and its
    int8 kernel, whose tiles do not depend on the rows either). The ``torch``
    (reference) backend has no invariant ops: ``ValueError``.
    """
    if backend.name == "cpu":
        decode, linear = _cpu_decode, native.linear_rows
        linear_int8 = native.linear_int8_rows  # the C kernel for every row count
        lora = add_lora_fixed
    elif backend.name == "triton":
        from kernels import invariant_matmul

        decode, linear = _triton_decode, invariant_matmul.linear
        linear_int8 = backend.linear_int8  # one tile shape for every row count already
        lora = backend.lora  # the Triton kernel: a program per row
    else:
        raise ValueError("the batch-invariant mode runs on the cpu and triton attention "
                         f"backends, not {backend.name!r}")
    return replace(backend, decode=decode, prefill=prefill_as_decode(decode), cascade=False,
                   linear=linear, linear_int8=linear_int8, lora=lora)
