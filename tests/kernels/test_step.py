"""One engine step through ``get_ops("triton")``: cache the step's K/V, then decode the first
sequences and prefill the rest, as the paged-attention layer does; compared with the torch ops."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels import get_ops

# Decodes first (q_len 1), then prefill chunks: a fresh prompt, a chunk after a cached prefix.
SEQS = [(1, 1), (17, 1), (300, 1), (16, 16), (200, 33)]
NUM_DECODE = 3


def run_step(ops, batch):
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    ops.reshape_and_cache(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    scale = batch.query.shape[2] ** -0.5
    nd = NUM_DECODE
    decode = ops.decode(
        batch.query[:nd],
        key_cache,
        value_cache,
        batch.block_tables[:nd],
        batch.seq_lens[:nd],
        scale,
    )
    prefill = ops.prefill(
        batch.query[nd:],
        key_cache,
        value_cache,
        batch.block_tables[nd:],
        batch.query_start_loc[nd:] - batch.query_start_loc[nd],
        batch.seq_lens[nd:],
        scale,
    )
    return torch.cat([decode, prefill]), key_cache, value_cache


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (9, 3, 64, 16, torch.float32),  # SmolLM2-135M's layout
        (8, 1, 80, 32, torch.float32),
        (9, 3, 64, 16, torch.bfloat16),
    ],
)
def test_mixed_step_matches_torch_ops(
    paged_batch, assert_matches, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    batch = paged_batch(
        SEQS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    out, key_cache, value_cache = run_step(get_ops("triton"), batch)
    ref, ref_key_cache, ref_value_cache = run_step(get_ops("torch"), batch)
    assert torch.equal(key_cache, ref_key_cache) and torch.equal(value_cache, ref_value_cache)
    assert_matches(out, ref)


def test_importing_kernels_does_not_import_triton():
    code = (
        "import sys, kernels; kernels.get_ops('torch'); "
        "sys.exit(1 if 'triton' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
