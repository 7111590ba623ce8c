"""Torch reference of the paged-KV attention ops: the spec the Triton kernels are tested against.

Layouts (shared by every implementation of these ops):

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:           [num_seqs, max_blocks_per_seq] int32, logical block -> physical block
    seq_lens:               [num_seqs] int32, context tokens per sequence, new ones included
    query_start_loc:        [num_seqs + 1] int32, prefix sums of the new tokens per sequence
    slot_mapping:           [num_tokens] int64, slot = block * block_size + offset; < 0 = padding

A sequence with ``q_len`` new tokens and ``seq_len`` tokens of context has its new tokens at
positions ``seq_len - q_len .. seq_len - 1``; new token ``j`` attends to positions ``0 ..
seq_len - q_len + j`` (causal within the chunk, full over the cached prefix). Query heads are
grouped over KV heads: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
Softmax is computed in float32 whatever the input dtype; the output has the query's dtype.

These functions are also the CPU execution path of the engine, so they avoid per-token loops;
decode is fully batched, prefill loops over sequences (a step holds few prefill chunks).
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = padding (skipped)
) -> None:
    """Write each token's K and V into its physical slot of the block pool, in place."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(value_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_of_seq] (one row of block_tables)
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first ``seq_len`` tokens of one sequence's K or V, in logical order."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, H_kv, D]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new token per sequence over its whole paged context."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    # Padded gather: [B, L, H_kv, D] with L = num_blocks * block_size; padding is masked below.
    k = key_cache[tables].flatten(1, 2).float()
    v = value_cache[tables].flatten(1, 2).float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale  # [B, H_kv, G, L]
    positions = torch.arange(k.shape[1], device=query.device)
    pad = positions[None, :] >= seq_lens[:, None].long()  # [B, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], new tokens of all sequences
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Varlen attention of chunks of new tokens over their paged context (chunked prefill).

    The K/V of the new tokens must already be in the cache (``reshape_and_cache`` first).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[i], seq_len).float()  # [S, H_kv, D]
        v = gather_kv(value_cache, block_tables[i], seq_len).float()
        q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,shd->hgqs", q, k) * scale  # [H_kv, G, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        future = k_pos[None, :] > q_pos[:, None]  # [q_len, S]
        scores.masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqs,shd->qhgd", probs, v)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(query.dtype)
    return out


def mask_rows_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf where bit ``t`` of ``bitmask[i]`` (int32 words, token
    ``t`` at bit ``t % 32`` of word ``t // 32``) is clear, in place."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[rows] = bits.to(logits.device) == 0
    logits.masked_fill_(banned, float("-inf"))
