"""Attention metadata of one step and the paged-attention layer that consumes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import Backend
from kernels.lora import LoRAMapping


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flattened varlen batch reads and writes its KV.

    The first ``num_decode_tokens`` tokens are decodes (one token per sequence, so the first
    ``num_decode_tokens`` sequences); the rest are prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    num_decode_tokens: int
    prefill_query_start_loc: torch.Tensor  # [B - num_decode + 1] int32, rebased to 0
    # Decode rows sharing their first blocks, and how many (for cascade backends only; 0 when
    # this step's decodes run without cascade).
    decode_prefix: tuple[torch.Tensor, int] | None = None
    # Each row's LoRA adapter slot (``kernels.lora``); None when no row of the step has one.
    lora: LoRAMapping | None = None


def softmax_scale(head_dim: int) -> float:
    """The scale of the attention scores, ``1 / sqrt(head_dim)``."""
    return head_dim**-0.5


class PagedAttention(torch.nn.Module):
    """Writes the step's K/V into the block pool, then attends over each sequence's blocks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: Backend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = softmax_scale(head_dim)
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.backend.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        cascade = {"prefix": meta.decode_prefix} if meta.decode_prefix is not None else {}
        if nd == q.shape[0]:
            return self.backend.decode(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale,
                **cascade,
            )
        prefill = self.backend.prefill(
            q[nd:],
            key_cache,
            value_cache,
            meta.block_tables[nd:],
            meta.prefill_query_start_loc,
            meta.seq_lens[nd:],
            self.scale,
        )
        if nd == 0:
            return prefill
        decode = self.backend.decode(
            q[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
            self.scale, **cascade,
        )
        return torch.cat([decode, prefill])
