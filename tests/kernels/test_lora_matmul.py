"""Batched LoRA: the Triton kernels and the CPU path against ``add_lora_reference``, rows of
several adapters (ranks padded to the largest) and of none mixed in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora import LoRAMapping, LoRASlots, add_lora, add_lora_reference
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


@pytest.mark.parametrize(("slots", "in_features", "out_features", "ranks", "dtype"), CASES)
def test_triton_matches_reference(slots, in_features, out_features, ranks, dtype):
    g = torch.Generator().manual_seed(7)
    a, b = _weights(in_features, out_features, ranks, dtype)
    x = torch.randn(len(slots), in_features, generator=g).to(dtype)
    y = torch.randn(len(slots), out_features, generator=g).to(dtype)
    index = torch.tensor(slots, dtype=torch.int32)
    want = add_lora_reference(x, y, a, b, index)

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
    weights = [(a[s, :r], b[s, :, :r]) for s, r in enumerate(ranks)]
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
    slots = LoRASlots([(a[0], b[0]), (a[1], b[1])])
    x, y = torch.randn(3, 16), torch.zeros(3, 8)
    mapping = LoRAMapping.of(np.array([0, 1, -1]), torch.device("cpu"))
    assert mapping is not None
    first = slots.add(x, y.clone(), mapping)
    slots.weights[1] = (a[1] * 2, b[1])
    second = slots.add(x, y.clone(), mapping)
    torch.testing.assert_close(second[0], first[0])
    torch.testing.assert_close(second[1], 2 * first[1])
    assert torch.equal(second[2], y[2])


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
