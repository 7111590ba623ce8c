"""The shapes every attention kernel is tested on (STYLE 7 and the issue's list), and the
shared-prefix batches of cascade decode."""

import torch

from kernels.cascade import CASCADE_MIN_TOKENS, shared_prefix

HEAD_DIMS = [64, 80, 13]
BLOCK_SIZES = [16, 32]
HEADS = [(4, 4), (9, 3), (8, 1)]  # (num_heads, num_kv_heads): GQA ratios 1, 3, 8

# Cascade decode: (seq_len, 1) per row; the shortest row bounds the shared prefix.
CASCADE_SEQS = [(120, 1), (97, 1), (200, 1), (81, 1), (150, 1), (77, 1)]


def share_prefix(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 sharers: list[int], consecutive: bool = False
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
    """``block_tables`` with ``sharers``' rows starting with row ``sharers[0]``'s blocks, as
    many as the shortest sharer leaves (each keeps its newest token); ``consecutive`` makes
    those blocks one run, as one prompt's prefill allocates them. Returns the tables and the
    ``prefix`` argument of the decode ops (rows on the tables' device)."""
    tables = block_tables.clone().cpu()
    lens = seq_lens.cpu()
    shared_blocks = (int(lens[sharers].min()) - 1) // block_size
    first = sharers[0]
    if consecutive:
        tables[first, :shared_blocks] = torch.arange(3, 3 + shared_blocks, dtype=tables.dtype)
    for row in sharers:
        tables[row, :shared_blocks] = tables[first, :shared_blocks]
    rows, shared = shared_prefix(tables.numpy(), lens.numpy(), block_size)
    assert rows.tolist() == sorted(sharers) and shared == shared_blocks
    assert shared * block_size >= CASCADE_MIN_TOKENS  # the cascade path really runs
    device = block_tables.device
    return tables.to(device), (torch.from_numpy(rows).to(device), shared)
