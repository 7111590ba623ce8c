"""The C grammar-mask kernel against the torch reference and xgrammar's own kernel: random
bitmasks (all-allowed words, all-banned words, single bits), a vocabulary that is not a
multiple of 32, a subset of rows, strided logits."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kernels import native, reference


@pytest.mark.parametrize("vocab", [32, 100, 49152 + 7])
def test_mask_rows_matches_reference_and_xgrammar(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    n, rows = 6, torch.tensor([0, 2, 5])
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32,
                            generator=gen)
    bitmask[0, ::3] = -1  # every token of the word allowed
    bitmask[1, 1::4] = 0  # none
    bitmask[2, :] = 1 << 5  # one token per word
    base = torch.randn(n, vocab + 3, generator=gen)[:, :vocab]  # a row stride past vocab
    ours, ref = base.clone(), base.clone()
    native.mask_rows_(ours, bitmask, rows)
    reference.mask_rows_(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    full = torch.full((n, words), -1, dtype=torch.int32)
    full[rows] = bitmask
    theirs = base.contiguous().clone()
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3, 4]], base[[1, 3, 4]])  # rows not listed are untouched
    assert (ours[5, :32] == float("-inf")).sum() == 31  # row 5 takes bitmask[2]: one bit


def test_mask_rows_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        native.mask_rows_(torch.zeros(1, 32, dtype=torch.bfloat16),
                          torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
