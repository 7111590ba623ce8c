"""CPU paged attention fast enough to serve from; same signatures and semantics as the reference.

Decode is memory-bound: the reference gathers every sequence's K/V into a padded copy, upcasts
it and then reads it again. Here it runs in a C kernel (``kernels/cpu_decode.c``, built by
``kernels.native``) that reads each K/V element once straight from its block, with float32
accumulation whatever the cache dtype, plus cascade attention for shared prefixes. Prefill
chunks are compute-bound and go through torch's fused CPU attention
(``scaled_dot_product_attention``) per sequence.

Checked against ``kernels.reference`` in the tests.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels import native, reference
from kernels.cascade import runs_cascade, shared_prefix
from kernels.native import PrefixSeed, paged_decode
from kernels.reference import gather_kv

__all__ = ["paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's K/V into the pool (see the reference): row copies in C when the
    rows already have the cache's dtype (the engine's case), else the reference."""
    if key.dtype == key_cache.dtype and value.dtype == value_cache.dtype:
        native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _prefix_attention(
    query: torch.Tensor,  # [R, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,  # [k] the shared blocks, all full (on the CPU)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [R, H, D] in the query's dtype, lse [R, H] float32
    rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    # Every row's query heads of one KV head as that head's queries: [1, H_kv, R*G, D]
    # against the prefix's [1, H_kv, P, D], in torch's fused CPU attention (float32
    # accumulation, blocked GEMMs in the cache dtype), which also returns the log-sum-exp.
    ids = blocks.numpy()
    first, count = int(ids[0]), len(ids)
    if np.array_equal(ids, np.arange(first, first + count)):  # one prefill's blocks: no copy
        k, v = key_cache[first : first + count], value_cache[first : first + count]
    else:
        k, v = key_cache[blocks.long()], value_cache[blocks.long()]
    k = k.flatten(0, 1).transpose(0, 1)[None]
    v = v.flatten(0, 1).transpose(0, 1)[None]
    q = query.view(rows, num_kv_heads, group, head_dim).transpose(0, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(1, num_kv_heads, rows * group, head_dim), k, v, scale=scale
    )
    out = out.view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
    lse = lse.view(num_kv_heads, rows, group).transpose(0, 1)
    return out.reshape(rows, num_heads, head_dim), lse.reshape(rows, num_heads)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefix: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (see the reference).

    Cascade attention for shared prefixes: when many sequences' block tables start with the
    same blocks (one system prompt, prefix-cached), those blocks are read once for all of
    them in one fused attention call, and the kernel starts each of those sequences from that
    result and reads only its own blocks. Decode is bound by K/V reads, so this saves the shared
    prefix's share of them. ``prefix`` is ``shared_prefix``'s answer (rows as a tensor) when
    the caller has it (the engine finds it once per step); it is found here otherwise.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    block_size = key_cache.shape[1]
    if prefix is None:
        rows, shared = shared_prefix(block_tables.numpy(), seq_lens.numpy(), block_size)
        prefix = torch.from_numpy(rows), shared
    rows, shared = prefix
    seed = None
    if runs_cascade(len(rows), shared, block_size):
        blocks = block_tables[rows[0], :shared]
        out, lse = _prefix_attention(query[rows], key_cache, value_cache, blocks, scale)
        seed = PrefixSeed(rows, shared, out, lse)
    out, _ = paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, seed)
    return out.to(query.dtype)


# Mask elements (q_len * G * S) up to which a prefill chunk after a cached prefix folds each KV
# head's query heads into its rows; past them (a long chunk over a long context) the mask G
# times as large costs more memory than the fold saves time. On a 2-core Zen 4 EPYC (the 1B's
# heads, bf16, 2026-12-07): 32 chunks of 50 tokens over 220 1.1-1.2x enable_gqa's head by head,
# 500 over 2,000 (4M elements) 1.2-1.3x, 30 over 2,000 0.92-1.03x.
FOLDED_MASK_MAX = 1 << 23


def _chunk_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, seq_len]: which keys each of a chunk's last ``q_len`` positions sees."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


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
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[i], seq_len).transpose(0, 1)  # [H_kv, S, D]
        v = gather_kv(value_cache, block_tables[i], seq_len).transpose(0, 1)
        group = num_heads // k.shape[0]
        if q_len == seq_len or q_len * group * seq_len > FOLDED_MASK_MAX:
            q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
            mask = None if q_len == seq_len else _chunk_mask(q_len, seq_len, query.device)
            o = F.scaled_dot_product_attention(  # head by head; plain causal without a prefix
                q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=True)
            out[q_start:q_end] = o[0].transpose(0, 1)
            continue
        # A chunk after a cached prefix: each KV head's query heads as rows of that head,
        # [H_kv, q_len * G, D], so that one GEMM a KV head takes all of them.
        q = query[q_start:q_end].view(q_len, -1, group, head_dim).permute(1, 0, 2, 3)
        mask = _chunk_mask(q_len, seq_len, query.device)
        o = F.scaled_dot_product_attention(
            q.reshape(1, -1, q_len * group, head_dim), k[None], v[None],
            attn_mask=mask.repeat_interleave(group, dim=0), scale=scale)
        out[q_start:q_end] = o.view(-1, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(
            q_len, num_heads, head_dim)
    return out
