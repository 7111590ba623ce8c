"""Batched LoRA: the Triton kernels, the CPU path and the C kernel (``cpu_linear.c``'s
``lora_add``) against ``add_lora_reference``, rows of several adapters (ranks padded to the
largest) and of none mixed in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import native
from kernels.lora import (
    LORA_C_MAX_ROWS,
    LoRAMapping,
    LoRASlots,
    add_lora,
    add_lora_cpu,
    add_lora_fixed,
    add_lora_reference,
    stack_slots,
)
from kernels.lora_triton import add_lora_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative to the largest reference element (and elementwise, on top), as the attention tests.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (rows' slots, in features, out features, ranks of the slots, dtype)
CASES = [
    ([0, 1, -1, 2, 2, 2, 0, -1, 1], 60, 96, (8, 16, 4), torch.float32),
    ([-1], 13, 7, (8,), torch.float32),  # one base row: nothing added
    ([1], 13, 7, (3, 5), torch.float32),  # one row, the larger rank
    ([2, 2, 2, 2, 2, 0, 1, 1, 0, -1, -1, 2], 80, 130, (16, 8, 1), torch.float32),
    # more rows than the CPU's concatenated path takes: two matmuls per adapter on its rows
    ([i % 4 - 1 for i in range(40)], 24, 40, (8, 16, 4), torch.float32),
    ([0, -1, 1, 1], 64, 64, (16, 8), torch.float16),
    ([1, 0, 0, -1, 1], 33, 50, (8, 16), torch.bfloat16),
]


def _weights(in_features, out_features, ranks, dtype):
    g = torch.Generator().manual_seed(len(ranks) * in_features + out_features)
    r_max = max(ranks)
    a = torch.zeros(len(ranks), r_max, in_features)
    b = torch.zeros(len(ranks), out_features, r_max)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_features, generator=g) / in_features**0.5
        b[s, :, :r] = torch.randn(out_features, r, generator=g)
    return a.to(dtype), b.to(dtype)


def _case(slots, in_features, out_features, ranks, dtype, seed):
    """A case's stacked weights, rows x and y, their slots, and the reference's result."""
    g = torch.Generator().manual_seed(seed)
    a, b = _weights(in_features, out_features, ranks, dtype)
    x = torch.randn(len(slots), in_features, generator=g).to(dtype)
    y = torch.randn(len(slots), out_features, generator=g).to(dtype)
    index = torch.tensor(slots, dtype=torch.int32)
    return a, b, x, y, index, add_lora_reference(x, y, a, b, index)


@pytest.mark.parametrize(("slots", "in_features", "out_features", "ranks", "dtype"), CASES)
def test_triton_matches_reference(slots, in_features, out_features, ranks, dtype):
    a, b, x, y, index, want = _case(slots, in_features, out_features, ranks, dtype, seed=7)

    got = add_lora_triton(x.to(DEVICE), y.clone().to(DEVICE), a.to(DEVICE), b.to(DEVICE),
                          index.to(DEVICE)).cpu()

    tol = TOLERANCE[dtype] * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=TOLERANCE[dtype])
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base], y[base])  # base rows untouched
    adapted = [t for t, s in enumerate(slots) if s >= 0]
    if adapted:
        assert not torch.equal(got[adapted], y[adapted])


@pytest.mark.parametrize(("slots", "in_features", "out_features", "ranks", "dtype"), CASES[:5])
def test_cpu_path_matches_reference(slots, in_features, out_features, ranks, dtype):
    # The CPU path reads each slot's unpadded weights, rows by segment (a slice when they are
    # contiguous, an index otherwise).
    g = torch.Generator().manual_seed(3)
    a, b = _weights(in_features, out_features, ranks, dtype)
    weights = [(a[s, :r], b[s, :, :r].t()) for s, r in enumerate(ranks)]  # A, Bt
    x = torch.randn(len(slots), in_features, generator=g)
    y = torch.randn(len(slots), out_features, generator=g)
    mapping = LoRAMapping.of(np.array(slots), torch.device("cpu"))
    want = add_lora_reference(x, y, a, b, torch.tensor(slots, dtype=torch.int32))
    if mapping is None:
        assert all(s < 0 for s in slots)
        return
    got = add_lora(x, y.clone(), weights, None, mapping)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Several adapters at once: one shrink and one expand over their concatenated weights
    # (kept for the next step with the same adapters).
    slots = LoRASlots(weights)
    for _ in range(2):
        got = slots.add(x, y.clone(), mapping)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_concat_follows_the_slots_weights():
    # A slot given another adapter's weights (one unloaded, another loaded in its place) is
    # not served from the concatenation of the previous ones.
    a, b = _weights(16, 8, (4, 4), torch.float32)
    bt = b.transpose(1, 2)
    slots = LoRASlots([(a[0], bt[0]), (a[1], bt[1])])
    x, y = torch.randn(3, 16), torch.zeros(3, 8)
    mapping = LoRAMapping.of(np.array([0, 1, -1]), torch.device("cpu"))
    assert mapping is not None
    first = slots.add(x, y.clone(), mapping)
    slots.weights[1] = (a[1] * 2, bt[1])
    second = slots.add(x, y.clone(), mapping)
    torch.testing.assert_close(second[0], first[0])
    torch.testing.assert_close(second[1], 2 * first[1])
    assert torch.equal(second[2], y[2])
    # unloaded, then another loaded: Python may give the new pair the freed one's id
    slots.weights[1] = None
    slots.weights[1] = (a[1] * 3, bt[1])
    third = slots.add(x, y.clone(), mapping)
    torch.testing.assert_close(third[1], 3 * first[1])


def test_mapping_segments():
    mapping = LoRAMapping.of(np.array([-1, 2, 2, 0, -1, 0, 2]), torch.device("cpu"))
    assert mapping is not None
    assert mapping.index.tolist() == [-1, 2, 2, 0, -1, 0, 2]
    (slot0, rows0), (slot2, rows2) = mapping.segments
    assert (slot0, slot2) == (0, 2)
    assert torch.equal(rows0, torch.tensor([3, 5])) and torch.equal(rows2, torch.tensor([1, 2, 6]))
    contiguous = LoRAMapping.of(np.array([1, 1, 1, -1]), torch.device("cpu"))
    assert contiguous is not None and contiguous.segments == ((1, slice(0, 3)),)
    assert LoRAMapping.of(np.array([-1, -1]), torch.device("cpu")) is None


def test_mismatched_shapes_are_refused():
    a, b = _weights(16, 8, (4,), torch.float32)
    x, y = torch.zeros(2, 16), torch.zeros(2, 9)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora_triton(x, y, a, b, torch.zeros(2, dtype=torch.int32))


# The C kernel: float32 and bf16; and outputs over several of its expand's blocks of 512.
C_CASES = [*(c for c in CASES if c[4] != torch.float16),
           ([0, 1, -1, 1, 0, 0], 40, 1100, (8, 4), torch.bfloat16)]


@pytest.mark.parametrize(("slots", "in_features", "out_features", "ranks", "dtype"),
                         [*C_CASES, *((*c[:4], torch.bfloat16) for c in C_CASES[:1])])
def test_c_kernel_matches_reference(slots, in_features, out_features, ranks, dtype):
    a, b, x, y, index, want = _case(slots, in_features, out_features, ranks, dtype, seed=11)
    # the last slot has no pair for this projection (an adapter that does not adapt it)
    pairs = [(a[s, :r].contiguous(), b[s, :, :r].t().contiguous())
             for s, r in enumerate(ranks)]
    table = native.LoRATable([*pairs[:-1], None])
    got = native.lora_add_(x, y.clone(), table, index)

    mine = [t for t, s in enumerate(slots) if s != len(ranks) - 1]
    tol = TOLERANCE[dtype] * want.float().abs().max().item()
    torch.testing.assert_close(got[mine].float(), want[mine].float(), atol=tol,
                               rtol=TOLERANCE[dtype])
    untouched = [t for t, s in enumerate(slots) if s < 0 or s == len(ranks) - 1]
    assert torch.equal(got[untouched], y[untouched])


def test_fixed_order_is_per_row():
    # The batch-invariant mode's add_lora_fixed: a row's product is the same bits alone and
    # among more rows of its slot than add_lora_cpu gives the C kernel (its tiles at every row
    # count), where add_lora_cpu's torch path (prefill) takes another order.
    rows = LORA_C_MAX_ROWS + 4
    a, b = _weights(256, 330, (16,), torch.bfloat16)  # 330: a tail past the vectors
    slots = LoRASlots([(a[0], b[0].t().contiguous())])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    y = torch.randn(rows, 330, generator=g).to(torch.bfloat16)
    batch = add_lora_fixed(slots, x, y.clone(), _one_slot(rows))
    for t in (0, 57, rows - 1):
        alone = add_lora_fixed(slots, x[t : t + 1], y[t : t + 1].clone(), _one_slot(1))
        assert torch.equal(alone[0], batch[t])
    assert not torch.equal(add_lora_cpu(slots, x, y.clone(), _one_slot(rows)), batch)


def _one_slot(rows: int) -> LoRAMapping:
    mapping = LoRAMapping.of(np.zeros(rows, dtype=np.int64), torch.device("cpu"))
    assert mapping is not None
    return mapping


def test_cpu_backend_paths_follow_the_slots_table():
    # add_lora_fixed reads the table LoRASlots keeps, refreshed when its weights change (here
    # by in_c: a slot given an adapter without refresh()); adapters the C kernel cannot take
    # (float16) are refused there, not skipped.
    a, b = _weights(16, 8, (4, 4), torch.float32)
    bt = b.transpose(1, 2).contiguous()
    slots = LoRASlots([(a[0].contiguous(), bt[0]), None])
    x, y = torch.randn(3, 16), torch.zeros(3, 8)
    mapping = LoRAMapping.of(np.array([0, 1, -1]), torch.device("cpu"))
    assert mapping is not None
    first = add_lora_fixed(slots, x, y.clone(), mapping)
    assert torch.equal(first[1], y[1]) and not torch.equal(first[0], y[0])
    slots.weights[1] = (a[1].contiguous(), bt[1])
    second = add_lora_fixed(slots, x, y.clone(), mapping)
    torch.testing.assert_close(second, add_lora_reference(x, y, a, b, mapping.index))
    half = LoRASlots([(a[0].half(), bt[0].half())])
    assert not half.c_ready
    with pytest.raises(TypeError, match="adapters"):
        add_lora_fixed(half, x.half(), y.half(), mapping)


def test_c_kernel_refusals():
    a, b = _weights(16, 8, (4,), torch.float32)
    bt = b.transpose(1, 2).contiguous()
    table = native.LoRATable([(a[0], bt[0])])
    index = torch.zeros(2, dtype=torch.int32)
    for x, y, idx, match in (
            (torch.zeros(2, 16), torch.zeros(2, 9), index, "adapters of 16 -> 8"),
            (torch.zeros(2, 16), torch.zeros(3, 8), index, "rows"),
            (torch.zeros(2, 16), torch.zeros(2, 8), index.long(), "int32"),
            (torch.zeros(2, 16).bfloat16(), torch.zeros(2, 8).bfloat16(), index, "dtype")):
        with pytest.raises(ValueError, match=match):
            native.lora_add_(x, y, table, idx)
    for pairs in ([(a[0], bt[0]), (a[0][:, :15].contiguous(), bt[0])],  # another in-features
                  [(a[0], bt[0][:3])],  # Bt's rank is not A's
                  [(a[0], bt[0].bfloat16())],  # two dtypes
                  [(a[0].t().contiguous().t(), bt[0])]):  # not contiguous
        with pytest.raises(ValueError, match="LoRATable"):
            native.LoRATable(pairs)
    with pytest.raises(TypeError, match="float16"):
        native.LoRATable([(a[0].half(), bt[0].half())])


def test_stacked_slots_are_the_pairs_padded():
    # The Triton kernels' layout (built from the slots on CUDA): the reference over it gives
    # what the per-slot CPU path gives, a slot without a pair adding nothing.
    a, b = _weights(24, 40, (8, 3, 5), torch.float32)
    pairs = [(a[0], b[0].t().contiguous()), None, (a[2, :5], b[2, :, :5].t().contiguous())]
    stacked = stack_slots(pairs, 24, 40)
    assert stacked is not None and stacked[0].shape == (3, 8, 24) and stacked[1].shape == (3, 40, 8)
    slots = [2, 0, 1, -1, 2]
    x, y = torch.randn(5, 24), torch.randn(5, 40)
    mapping = LoRAMapping.of(np.array(slots), torch.device("cpu"))
    assert mapping is not None
    want = add_lora(x, y.clone(), pairs, None, mapping)
    got = add_lora_reference(x, y, *stacked, torch.tensor(slots, dtype=torch.int32))
    torch.testing.assert_close(got, want)
    assert torch.equal(got[2], y[2]) and stack_slots([None, None], 24, 40) is None
