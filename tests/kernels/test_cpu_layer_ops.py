"""The fused CPU layer ops (kernels/cpu_layer.c) against transformers' eager formulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Sums of squares and exp may differ from torch's in the last bits of float32; after that
# everything rounds as torch rounds, so the results agree to about one unit in the last place.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (3, 576), (37, 100), (300, 960)])
def test_rms_norm_matches_transformers(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    _close(native.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (5, 576), (300, 960)])
def test_rms_norm_with_residual_adds_in_place_first(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    total = x + residual  # rounded to the dtype, as transformers' residual add
    out = native.rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(residual, total)
    _close(out, _hf_rms_norm(total, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "heads", "head_dim"), [(1, 1, 2), (7, 12, 64), (300, 5, 80)])
def test_rotary_is_bit_identical_to_transformers(dtype, rows, heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(2)
    # A strided view, as the model rotates q and k inside the fused qkv projection's output.
    qkv = torch.randn(rows, heads + 3, head_dim, generator=gen).to(dtype)
    x = qkv[:, :heads]
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    expected = x * cos[:, None] + rotated * sin[:, None]
    untouched = qkv[:, heads:].clone()
    native.rotary_(x, cos, sin)
    assert torch.equal(qkv[:, :heads], expected)
    assert torch.equal(qkv[:, heads:], untouched)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "head_dim"),
                         [(1, 2, 1, 8), (7, 16, 8, 128), (300, 4, 2, 24)])
def test_head_norms_norm_each_query_and_key_head_in_place(dtype, rows, heads, kv_heads,
                                                          head_dim) -> None:
    gen = torch.Generator().manual_seed(5)
    # q and k heads inside the fused qkv projection's output, v's heads after them
    qkv = (torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(dtype)
    q_weight, k_weight = (torch.randn(head_dim, generator=gen).to(dtype) for _ in range(2))
    q, k, v = (t.clone() for t in qkv.split([heads, kv_heads, kv_heads], dim=1))
    native.head_norms_(qkv[:, :heads + kv_heads], heads, q_weight, k_weight, 1e-6)
    _close(qkv[:, :heads], _hf_rms_norm(q, q_weight, 1e-6))  # Qwen3RMSNorm, per head
    _close(qkv[:, heads:heads + kv_heads], _hf_rms_norm(k, k_weight, 1e-6))
    assert torch.equal(qkv[:, heads + kv_heads:], v)
    # each head exactly as rms_norm norms a row (the kernel the model's other norms run)
    assert torch.equal(qkv[:, :heads], native.rms_norm(q.contiguous(), q_weight, 1e-6))
    assert torch.equal(qkv[:, heads:heads + kv_heads],
                       native.rms_norm(k.contiguous(), k_weight, 1e-6))


def test_head_norms_add_their_eps() -> None:
    # Heads of values about 1e-3, whose mean square eps = 1e-2 outweighs: dropped or passed
    # wrong, the outputs would be some hundred times off.
    gen = torch.Generator().manual_seed(6)
    qk = torch.randn(3, 5, 16, generator=gen) * 1e-3
    q_weight, k_weight = torch.rand(16, generator=gen) + 0.5, torch.rand(16, generator=gen) + 0.5
    expected = torch.cat([_hf_rms_norm(qk[:, :3], q_weight, 1e-2),
                          _hf_rms_norm(qk[:, 3:], k_weight, 1e-2)], dim=1)
    native.head_norms_(qk, 3, q_weight, k_weight, 1e-2)
    _close(qk, expected)
    assert qk.abs().max() < 0.1  # eps held the norm down


def test_head_norms_refuse_what_they_cannot_norm() -> None:
    qk = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"\[8\] weights"):
        native.head_norms_(qk, 2, torch.ones(8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"\[8\] weights"):
        native.head_norms_(qk, 2, torch.ones(8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="4 query heads of 3"):
        native.head_norms_(qk, 4, torch.ones(8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous heads"):
        native.head_norms_(torch.randn(2, 8, 3).transpose(1, 2), 2, torch.ones(8),
                           torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (9, 1536), (200, 130)])
def test_silu_mul_matches_transformers(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(shape[0], 2 * shape[1], generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(shape[1], dim=-1)
    _close(native.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (5, 16), (64, 49152), (2, 1000)])
def test_argmax_matches_torch_ties_nan_and_inf_included(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen).to(dtype)
    assert torch.equal(native.argmax(x), x.argmax(-1))
    rows, n = shape
    if n < 3:
        return
    x[0, n // 2] = x[0, n - 1] = 100.0  # a tie: the first one wins
    x[-1, n - 1] = 1e4  # the last element, past the whole vectors
    if rows > 2:
        x[1, 2] = float("nan")  # NaN counts as the largest, as in torch
        x[2] = float("-inf")  # all -inf: index 0
    assert torch.equal(native.argmax(x), x.argmax(-1))


def test_layer_ops_refuse_what_they_cannot_do() -> None:
    with pytest.raises(TypeError, match=r"no CPU kernel for torch\.float64"):
        native.silu_mul(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        native.argmax(torch.zeros(4, 8).t())
    with pytest.raises(ValueError, match="contiguous"):
        native.rms_norm(torch.zeros(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(TypeError, match="cos/sin in the dtype"):
        native.rotary_(torch.zeros(2, 1, 4), torch.zeros(2, 4, dtype=torch.bfloat16),
                       torch.zeros(2, 4, dtype=torch.bfloat16))
