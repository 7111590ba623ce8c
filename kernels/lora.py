"""Batched LoRA: rows of one step each add their own adapter's low-rank product.

Punica / S-LoRA style: every adapter resident on the device has a slot; a step gives each row
(token) the slot of its sequence's adapter, -1 for the base model, and every adapted
projection adds, row by row, ``(x @ A[slot].T) @ B[slot].T`` to its output (``B`` holds the
adapter's scaling). A fused projection (q|k|v, gate|up) stacks its parts' ``A`` along the rank
and places their ``B`` block-diagonally, so one shrink and one expand serve the whole of it.
Each slot keeps ``B`` transposed (``Bt``, ``[r, out]``): the C kernel's expand runs along the
output, a rank's row of ``Bt`` at a time, and torch's ``addmm`` takes it as it is.

:func:`add_lora_reference` is the spec, row by row over stacked weights; :func:`add_lora`
runs torch's path (one pair of matmuls per adapter present in the step, on its rows) or, on
CUDA, the Triton kernels of ``kernels.lora_triton`` (one program per row and output tile).
The cpu backend's :func:`add_lora_cpu` runs a step of few rows (decodes) through
``cpu_linear.c``'s ``lora_add`` (``kernels.native.lora_add_``), the kernel a decode step in
one C call runs too; the batch-invariant mode's :func:`add_lora_fixed` runs every step there
(a row's product in the kernel does not depend on the other rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kernels import native

# Most rows a step may have for the concatenated path: past it, each row computing every
# adapter's shrink costs more than two matmuls per adapter on its own rows (prefill steps).
CONCAT_MAX_ROWS = 32
# Most rows add_lora_cpu gives the C kernel (see c_max_rows). One rank-16 adapter on
# Llama-3.2-1B's qkv, gate_up and down projections (bf16, one slot; a 2-core Zen 4 EPYC,
# 2026-12-07, the expand's bf16 loads and broadcasts in one instruction each), ms for the three
# against torch's two matmuls: 0.12 against 0.31 at 8 rows, 0.36 against 0.53 at 32, 0.72
# against 0.90 at 64, 1.06 against 0.96 at 96, 1.37 against 1.14 at 128. At 96 rows it loses
# 0.1 ms a layer, and a decode step with adapted rows runs in one C call as far as it goes,
# which saves far more (the base model's 64-row steps: 396.8 ms in one call against 484.2
# layer by layer, 5.5 ms a layer; kernels.native's LINEAR_MAX_ROWS notes): to 96 rows, bf16's
# one-call limit there.
LORA_C_MAX_ROWS = 96
# The same where the kernel runs narrower: bf16 without AVX512-BF16's dot product (the shrink
# widens), float32 on AVX2 (8 floats a vector, two rows a pass in the expand). An x86-64-v3
# build on that Zen 4, the three projections: bf16 0.18 against 0.27 ms at 4 rows, 0.33 against
# 0.31 at 8, 0.66 against 0.45 at 16; float32 0.42 against 0.41 at 16, 0.82 against 0.60 at 32.
LORA_C_MAX_ROWS_NARROW = {torch.bfloat16: 8, torch.float32: 16}
# slot -> (A [r, in], Bt [r, out]) of the adapters that adapt a projection (None: it does not)
SlotWeights = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each row of a step uses; built once per step, read by every layer.

    ``index``: ``[T]`` int32 on the device, the slot of each row, -1 for none.
    ``segments``: for each slot present, its rows: a ``slice`` when they are contiguous (the
    usual case: a sequence's rows are), else a ``[n]`` int64 index tensor.
    """

    index: torch.Tensor
    segments: tuple[tuple[int, slice | torch.Tensor], ...]
    # Row masks of the concatenated path by column layout, made once per step (every layer's
    # projection of one kind has the same layout).
    _masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict, compare=False)

    def mask(self, layout: tuple[object, ...], col_slot: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
        """``[T, C]``: 1 where column ``c`` belongs to row ``t``'s slot (``col_slot[c] ==
        index[t]``), else 0; ``layout`` names ``col_slot``'s contents."""
        key = (*layout, dtype)
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = (self.index[:, None] == col_slot[None, :]).to(dtype)
        return m

    @classmethod
    def of(cls, slots: np.ndarray, device: torch.device) -> LoRAMapping | None:
        """The mapping of per-row ``slots`` (-1: no adapter); None when no row has one."""
        present = np.unique(slots[slots >= 0])
        if present.size == 0:
            return None
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for slot in present.tolist():
            rows = np.flatnonzero(slots == slot)
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            if hi - lo == rows.size:
                segments.append((slot, slice(lo, hi)))
            else:
                segments.append((slot, torch.from_numpy(rows).to(device)))
        index = torch.from_numpy(slots.astype(np.int32)).to(device)
        return cls(index, tuple(segments))


def add_lora(x: torch.Tensor, y: torch.Tensor, weights: SlotWeights,
             stacked: tuple[torch.Tensor, torch.Tensor] | None,
             mapping: LoRAMapping) -> torch.Tensor:
    """``y`` (``[T, out]``, a projection's output of ``x``: ``[T, in]``) plus each row's
    adapter product, in place.

    Args:
        weights: per slot, ``(A [r, in], Bt [r, out])`` or None (the CPU path reads these).
        stacked: ``A [S, R, in]`` and ``B [S, out, R]`` zero-padded to the largest rank, for
            the Triton path (CUDA); None elsewhere.
        mapping: the step's rows per slot.
    """
    if stacked is not None and x.is_cuda:
        from kernels.lora_triton import add_lora_triton

        return add_lora_triton(x, y, stacked[0], stacked[1], mapping.index)
    for slot, rows in mapping.segments:
        pair = weights[slot]
        if pair is None:
            continue
        a, bt = pair
        if isinstance(rows, slice):
            torch.addmm(y[rows], F.linear(x[rows], a), bt, out=y[rows])
        else:
            y.index_add_(0, rows, F.linear(x[rows], a) @ bt)
    return y


def stack_slots(weights: SlotWeights, in_features: int, out_features: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every slot's ``(A, Bt)`` in the Triton kernels' layout: ``A [S, R, in]`` and ``B [S,
    out, R]``, zero-padded to the largest rank ``R``, on the adapters' device and dtype (what
    :func:`add_lora_reference` takes too); None without adapters."""
    pairs = [p for p in weights if p is not None]
    if not pairs:
        return None
    rank = max(a.shape[0] for a, _ in pairs)
    like = pairs[0][0]
    a = like.new_zeros(len(weights), rank, in_features)
    b = like.new_zeros(len(weights), out_features, rank)
    for slot, pair in enumerate(weights):
        if pair is not None:
            a[slot, : pair[0].shape[0]] = pair[0]
            b[slot, :, : pair[1].shape[0]] = pair[1].t()
    return a, b


def add_lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       index: torch.Tensor) -> torch.Tensor:
    """The spec: ``y[t] += B[s] @ (A[s] @ x[t])`` for every row ``t`` whose slot ``s =
    index[t]`` is not -1, accumulated in float32. ``a``: ``[S, R, in]``, ``b``:
    ``[S, out, R]``; returns a new tensor."""
    out = y.clone()
    for t, s in enumerate(index.tolist()):
        if s < 0:
            continue
        shrunk = a[s].float() @ x[t].float()  # [R]
        out[t] = (y[t].float() + b[s].float() @ shrunk).to(y.dtype)
    return out


@dataclass
class LoRASlots:
    """One projection's adapters, by slot: what ``add_lora`` reads (``weights``, and
    ``stacked`` on CUDA). Kept on the projection's module by ``engine.lora``.

    ``table`` holds the same adapters for the C kernel (``refresh`` after ``weights``
    change; :func:`in_c` refreshes a table that fell behind). In torch's path on the CPU, a
    step of at most ``CONCAT_MAX_ROWS`` rows that use several adapters runs them as one shrink
    and one expand over the present adapters' weights concatenated
    along the rank, each row masked to its own adapter's columns: a few large matmuls rather
    than two per adapter, each adapter's weights still read once. The concatenation is kept for
    the next step with the same adapters. Larger steps run two matmuls per adapter on its own
    rows.
    """

    weights: SlotWeights
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    # The CPU adapters' addresses for cpu_linear.c's lora_add (what add_lora_cpu and the
    # one-call decode step read): the same object for the holder's life, set by refresh().
    table: native.LoRATable = field(default_factory=native.LoRATable, compare=False)
    # the slots and pairs it was made of (held, so compared by identity), the layout, the
    # concatenated A and Bt, each column's slot
    _concat: tuple[list[tuple[int, tuple[torch.Tensor, torch.Tensor]]], tuple[object, ...],
                   torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _synced: SlotWeights = field(default_factory=list, compare=False)  # what table was set to
    # whether the table holds every adapter of weights (it may hold none), set by refresh()
    c_ready: bool = field(default=False, init=False, compare=False)

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Update ``table`` to ``weights``: whoever changes them calls it (``engine.lora``'s
        manager). The table is empty unless every adapter is on the CPU, contiguous, in float32
        or bf16 (``engine.lora`` loads them so)."""
        pairs = [p for p in self.weights if p is not None]
        c_ready = all(a.device.type == "cpu" and a.dtype in native.LINEAR_MAX_ROWS
                      and a.is_contiguous() and b.is_contiguous() for a, b in pairs)
        self.table.set(self.weights if c_ready else ())
        self._synced = list(self.weights)
        self.c_ready = c_ready

    def add(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """``y`` plus each row's adapter product."""
        present = tuple(s for s, _ in mapping.segments if self.weights[s] is not None)
        if (len(present) < 2 or x.shape[0] > CONCAT_MAX_ROWS
                or (self.stacked is not None and x.is_cuda)):
            return add_lora(x, y, self.weights, self.stacked, mapping)
        made = self._concat[0] if self._concat is not None else []
        if len(made) != len(present) or any(s != t or p is not self.weights[t] for (s, p), t
                                             in zip(made, present, strict=True)):
            key = [(s, p) for s in present if (p := self.weights[s]) is not None]
            a = torch.cat([p[0] for _, p in key])  # [sum R, in]
            bt = torch.cat([p[1] for _, p in key])  # [sum R, out]
            col_slot = torch.cat([torch.full((p[0].shape[0],), s, dtype=torch.int32)
                                  for s, p in key]).to(a.device)
            layout: tuple[object, ...] = tuple((s, p[0].shape[0]) for s, p in key)
            self._concat = (key, layout, a, bt, col_slot)
        _, layout, a, bt, col_slot = self._concat
        shrunk = F.linear(x, a)  # [T, C]: every adapter's shrink of every row
        shrunk *= mapping.mask(layout, col_slot, shrunk.dtype)
        return torch.addmm(y, shrunk, bt, out=y)


def in_c(slots: LoRASlots, dtype: torch.dtype) -> bool:
    """Whether ``slots``' table holds every adapter it has, for rows of ``dtype`` (refreshed
    first if its slots changed since)."""
    synced = slots._synced
    if len(synced) != len(slots.weights) or any(
            p is not q for p, q in zip(synced, slots.weights, strict=True)):
        slots.refresh()
    return slots.c_ready and slots.table.dtype in (None, dtype)


def c_max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``dtype`` :func:`add_lora_cpu` runs in the C kernel: as many as
    ``native.linear`` does, to ``LORA_C_MAX_ROWS`` (``LORA_C_MAX_ROWS_NARROW`` where this
    build's kernel widens bf16 or has 8 floats a vector)."""
    lib = native.library("cpu_linear")
    narrow = (not lib.linear_has_bf16_dot() if dtype == torch.bfloat16
              else lib.linear_vector_floats() == 8)
    limit = LORA_C_MAX_ROWS_NARROW.get(dtype, 0) if narrow else LORA_C_MAX_ROWS
    return min(native.linear_max_rows(dtype), limit)


def add_lora_cpu(slots: LoRASlots, x: torch.Tensor, y: torch.Tensor,
                 mapping: LoRAMapping) -> torch.Tensor:
    """The cpu backend's: a step of at most :func:`c_max_rows` rows (decodes) through
    ``cpu_linear.c``'s ``lora_add``, the kernel a decode step in one C call runs (so the two
    agree bit for bit); a larger one (prefill), or adapters the kernel does not take, as
    :meth:`LoRASlots.add`."""
    if in_c(slots, x.dtype) and x.shape[0] <= c_max_rows(x.dtype):
        return native.lora_add_(x.contiguous(), y, slots.table, mapping.index)
    return slots.add(x, y, mapping)


def add_lora_fixed(slots: LoRASlots, x: torch.Tensor, y: torch.Tensor,
                   mapping: LoRAMapping) -> torch.Tensor:
    """The batch-invariant cpu backend's: every step through ``lora_add``, whose product of a
    row does not depend on the rows beside it."""
    if not in_c(slots, x.dtype):
        raise TypeError(f"the batch-invariant mode's LoRA kernel takes {x.dtype} adapters on "
                        "the CPU")
    return native.lora_add_(x.contiguous(), y, slots.table, mapping.index)
