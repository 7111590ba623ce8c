"""Cascade attention's plan, shared by the backends that have it (``cpu``, ``triton``): which
decode rows start with the same KV blocks, so that a decode step reads those blocks once for
all of them and merges that partial softmax with each row's own."""

from __future__ import annotations

import numpy as np

# Cascade only when the shared prefix is long enough to pay for the extra pass.
CASCADE_MIN_TOKENS = 64


def shared_prefix(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, int]:
    """Rows sharing the most common first block, and how many leading blocks they share.

    Prefix caching gives sequences with one system prompt the same leading blocks. Each row
    keeps at least its newest token out of the shared part.
    """
    if len(block_tables) < 2:
        return np.zeros(0, dtype=np.int64), 0
    first = block_tables[:, 0]
    values, counts = np.unique(first, return_counts=True)
    rows = np.flatnonzero(first == values[counts.argmax()])
    if len(rows) < 2:
        return rows, 0
    tables = block_tables[rows]
    same = np.logical_and.accumulate((tables == tables[0]).all(axis=0))
    return rows, min(int(same.sum()), (int(seq_lens[rows].min()) - 1) // block_size)


def runs_cascade(num_rows: int, num_blocks: int, block_size: int) -> bool:
    """Whether a decode op given ``shared_prefix``'s answer reads the prefix once (cascade)."""
    return num_rows >= 2 and num_blocks * block_size >= CASCADE_MIN_TOKENS
