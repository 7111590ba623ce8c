"""CPU paged attention fast enough to serve from: the reference's maths, fused by inductor.

Decode is memory-bound: the reference gathers every sequence's K/V into a padded copy, upcasts
it and then reads it again. Here the same computation is written as elementwise products and
reductions over the block pool, which ``torch.compile`` turns into one C++ loop nest that reads
each K/V element once straight from its block (gather, upcast, dot product and masking fused),
with float32 accumulation whatever the cache dtype. Prefill chunks are compute-bound and go
through torch's fused CPU attention (``scaled_dot_product_attention``) per sequence.

Same signatures and semantics as ``kernels.reference``; checked against it in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from kernels.reference import gather_kv, reshape_and_cache

__all__ = ["paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"]


def _decode(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    value_cache: torch.Tensor,  # [N, block_size, H_kv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    q = query.float().view(num_seqs, 1, 1, num_kv_heads, group, head_dim)
    k = key_cache[block_tables][:, :, :, :, None, :]  # [B, nb, bs, H_kv, 1, D], fused gather
    scores = (q * k.float()).sum(-1) * scale  # [B, nb, bs, H_kv, G]
    pos = torch.arange(max_blocks * block_size, device=query.device)
    pad = pos.view(1, max_blocks, block_size, 1, 1) >= seq_lens.view(num_seqs, 1, 1, 1, 1)
    scores = scores.masked_fill(pad, float("-inf"))
    probs = torch.softmax(scores.view(num_seqs, -1, num_kv_heads, group), dim=1)
    probs = probs.view(num_seqs, max_blocks, block_size, num_kv_heads, group, 1)
    v = value_cache[block_tables][:, :, :, :, None, :]
    out = (probs * v.float()).sum(dim=(1, 2))  # [B, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


@cache
def _compiled_decode() -> Callable[..., torch.Tensor]:
    return torch.compile(_decode, dynamic=True)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (see the reference)."""
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    max_blocks = -(-int(seq_lens.max()) // key_cache.shape[1])
    tables = block_tables[:, :max_blocks].long()
    # The kernel is compiled for dynamic shapes, but torch specialises sizes 0 and 1: one
    # sequence or one block would compile it again. Pad both to two; the extra block is
    # masked (past seq_len) and the extra row's output is dropped.
    if max_blocks == 1:
        tables = torch.cat([tables, tables], dim=1)
    if num_seqs == 1:
        query, tables, seq_lens = (torch.cat([t, t]) for t in (query, tables, seq_lens))
    out = _compiled_decode()(query, key_cache, value_cache, tables, seq_lens, scale)
    return out[:num_seqs]


def paged_attention_prefill(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Varlen chunked-prefill attention over paged KV (see the reference)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[i], seq_len).transpose(0, 1)  # [H_kv, S, D]
        v = gather_kv(value_cache, block_tables[i], seq_len).transpose(0, 1)
        q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:
            mask = None  # no cached prefix: plain causal
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
