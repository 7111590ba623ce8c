"""Weight-only int8: symmetric quantization with a float32 scale per group of inputs, and the
torch reference of the int8 linear (dequantize, then ``F.linear``) that the C and Triton
kernels are checked against.

A quantized weight is a pair: ``q`` ``[N, K]`` int8 in [-127, 127] and ``scale`` ``[N, K / G]``
float32, ``W[n, k] ~= q[n, k] * scale[n, k // G]``. The group size ``G`` is ``K //
scale.shape[1]``: one scale per output channel (``G = K``) or per 32 inputs (GGUF's ``Q8_0``
blocks, loaded as they are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -128 is never produced, so q and -q are both representable


def group_size(q: torch.Tensor, scale: torch.Tensor) -> int:
    """The inputs per scale of a quantized weight (``K // scale.shape[1]``), checked."""
    n, k = q.shape
    if q.dtype != torch.int8 or scale.dtype != torch.float32:
        raise TypeError(f"an int8 weight is int8 with float32 scales, got {q.dtype}/{scale.dtype}")
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"scales of shape {tuple(scale.shape)} do not divide a [{n}, {k}] weight")
    return k // scale.shape[1]


def scale_group(q: torch.Tensor, scale: torch.Tensor) -> int:
    """:func:`group_size`, or 0 where there is one scale per output channel (whatever K): how
    ``kernels.native`` names the C kernel's paths."""
    group = group_size(q, scale)
    return 0 if scale.shape[1] == 1 else group


# Float32 bytes of weight rows ``quantize`` works on at a time: its temporaries (the rows
# widened, their magnitudes, the quotient) stay this size whatever the weight's.
QUANTIZE_CHUNK_BYTES = 16 << 20


def quantize(weight: torch.Tensor, group: int | None = None,
             out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ([N, K], any float dtype) as int8 with a scale per ``group`` inputs (``None``:
    per output channel): each group's largest magnitude maps to 127, values round to nearest.

    Returns ``(q [N, K] int8, scale [N, K / group] float32)``, written into ``out`` when it is
    given (a loader quantizes straight into the model's parameters); an all-zero group has
    scale 0. Rows are quantized ``QUANTIZE_CHUNK_BYTES`` at a time, so a real-size embedding
    table (Llama 3's 128256 x 2048) never has a float32 copy: whole, its temporaries took
    about 3 GB.
    """
    n, k = weight.shape
    group = k if group is None else group
    if group < 1 or k % group:
        raise ValueError(f"group size {group} does not divide {k} inputs")
    if out is None:
        out = (torch.empty(n, k, dtype=torch.int8, device=weight.device),
               torch.empty(n, k // group, dtype=torch.float32, device=weight.device))
    q, scale = out
    if q.shape != (n, k) or q.dtype != torch.int8 or scale.shape != (n, k // group) or (
            scale.dtype != torch.float32):
        raise ValueError(f"quantize's out is not int8 [{n}, {k}] with float32 "
                         f"[{n}, {k // group}] scales")
    step = max(1, QUANTIZE_CHUNK_BYTES // (4 * k))
    for n0 in range(0, n, step):
        w = weight[n0 : n0 + step].float().reshape(-1, k // group, group)
        s = w.abs().amax(dim=-1) / QMAX  # [rows, K / G]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        # whole numbers in [-127, 127] by now: the copy into int8 is exact
        q[n0 : n0 + step].copy_(torch.round(w / safe[..., None]).clamp_(-QMAX, QMAX)
                                .reshape(-1, k))
        scale[n0 : n0 + step].copy_(s)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The float weight ``q * scale`` ([N, K]) in ``dtype``, computed in float32."""
    g = group_size(q, scale)
    w = q.float().reshape(q.shape[0], -1, g) * scale[..., None]
    return w.reshape(q.shape).to(dtype)


def linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The spec: ``F.linear(x, dequantize(q, scale), bias)`` in float32, in ``x``'s dtype.

    Args:
        x: ``[M, K]`` rows, any float dtype.
        q: ``[N, K]`` int8 weights; scale: ``[N, K / G]`` float32.
        bias: ``[N]`` or None.
    """
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(q, scale).to(x.device), b).to(x.dtype)
