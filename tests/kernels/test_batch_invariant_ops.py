"""The batch-invariant mode's ops: each row's result bit for bit the same alone, among other
rows, at another position of the batch and (attention) in another prefill chunk; and close to
the reference. The Triton linear runs under the interpreter here (the conftest switches it on
without CUDA), on small awkward shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import get_ops, native, reference
from kernels.batch_invariant import invariant_ops, prefill_as_decode
from kernels.invariant_matmul import linear as triton_linear

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Triton linear's




def _check_invariant_linear(linear, m: int, n: int, k: int, dtype: torch.dtype,
                            bias: bool, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(device) if bias else None
    out = linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype],
                               atol=TOL[dtype] * float(ref.abs().max()))
    for i in sorted({0, m // 2, m - 1}):  # the first, a middle and the last row, alone
        assert torch.equal(linear(x[i : i + 1], w, b)[0], out[i]), f"row {i} of {m} differs"
    flipped = linear(x.flip(0), w, b)  # every row at another position, other neighbours
    assert torch.equal(flipped.flip(0), out)


# (M, N, K): rows around the C kernel's tile of 2 and the default's switch to GEMM at 4-8,
# Triton tiles of 64 (M, N) and 32 (K) cut awkwardly, K with a scalar tail.
@pytest.mark.parametrize(("m", "n", "k"), [(1, 13, 13), (9, 64, 100), (70, 70, 64),
                                           (33, 130, 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_linear_rows_do_not_depend_on_the_batch(m, n, k, dtype, row_exact_dot) -> None:
    _check_invariant_linear(triton_linear, m, n, k, dtype, bias=n == 130, device=DEVICE)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 13, 13), (9, 64, 100), (70, 96, 576),
                                           (200, 37, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_rows_do_not_depend_on_the_batch(m, n, k, dtype) -> None:
    _check_invariant_linear(native.linear_rows, m, n, k, dtype, bias=n == 37,
                            device=torch.device("cpu"))


def test_cpu_linear_rows_keep_one_order_where_the_default_changes_it() -> None:
    # bf16 rows of a wide range of magnitudes, so that the order of a sum shows in its bf16
    # rounding: 64 rows take the columns (AVX512-BF16) or a packed GEMM (without it) in the default
    # linear where the build has them, whose orders are not the tiles'. linear_rows must keep the
    # tiles' (a row alone is a lone stream).
    gen = torch.Generator().manual_seed(11)
    scale = 2.0 ** torch.randint(-12, 12, (64, 576), generator=gen)
    x = (torch.randn(64, 576, generator=gen) * scale).to(torch.bfloat16)
    w = torch.randn(96, 576, generator=gen).to(torch.bfloat16)
    out = native.linear_rows(x, w)
    for i in (0, 31, 63):
        assert torch.equal(native.linear_rows(x[i : i + 1], w)[0], out[i]), f"row {i} differs"
    lib = native.library("cpu_linear")
    columns = lib.linear_columns_from() and not lib.linear_has_amx()
    if columns or lib.linear_packed_from():  # the data tells the orders apart
        assert not torch.equal(native.linear(x, w), out)


def test_cpu_decode_row_alone_is_the_row_in_a_batch(cpu_paged_batch) -> None:
    # With 2 threads a lone row would be split in two runs merged after (split-K) by default.
    ops = invariant_ops(get_ops("cpu"))
    batch = cpu_paged_batch([(100, 1), (37, 1), (8, 1), (250, 1)], num_heads=6, num_kv_heads=2,
                        head_dim=64, block_size=8, dtype=torch.bfloat16)
    q = batch.query.contiguous()
    args = (batch.key_cache, batch.value_cache)
    together = ops.decode(q, *args, batch.block_tables, batch.seq_lens, 0.125)
    for i in range(4):
        alone = ops.decode(q[i : i + 1], *args, batch.block_tables[i : i + 1],
                           batch.seq_lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], together[i])
    ref = reference.paged_attention_decode(q, *args, batch.block_tables, batch.seq_lens, 0.125)
    torch.testing.assert_close(together.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_token_is_the_same_in_any_chunk(cpu_paged_batch, dtype) -> None:
    """A 40-token prompt's attention in one chunk, in chunks of 17 + 23 beside another
    sequence, and its last token as a decode row: the same bits for each token."""
    batch = cpu_paged_batch([(40, 40), (25, 25)], num_heads=4, num_kv_heads=2, head_dim=13,
                        block_size=8, dtype=dtype)
    ops = invariant_ops(get_ops("cpu"))
    prefill = prefill_as_decode(ops.decode)
    q, kc, vc = batch.query, batch.key_cache, batch.value_cache
    reference.reshape_and_cache(batch.key, batch.value, kc, vc, batch.slot_mapping)
    whole = prefill(q, kc, vc, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.3)
    ref = reference.paged_attention_prefill(q, kc, vc, batch.block_tables,
                                            batch.query_start_loc, batch.seq_lens, 0.3)
    torch.testing.assert_close(whole.float(), ref.float(), rtol=TOL[dtype] * 2,
                               atol=TOL[dtype] * 2)
    # the second chunk (tokens 17..39) of the first sequence, alone in its step
    second = prefill(q[17:40], kc, vc, batch.block_tables[:1],
                     torch.tensor([0, 23], dtype=torch.int32), torch.tensor([40]), 0.3)
    assert torch.equal(second, whole[17:40])
    # the first chunk (tokens 0..16) after the other sequence's whole prompt
    first = prefill(torch.cat([q[40:65], q[:17]]), kc, vc, batch.block_tables.flip(0),
                    torch.tensor([0, 25, 42], dtype=torch.int32), torch.tensor([25, 17]), 0.3)
    assert torch.equal(first[25:], whole[:17])
    last = ops.decode(q[39:40], kc, vc, batch.block_tables[:1], torch.tensor([40]), 0.3)
    assert torch.equal(last, whole[39:40])


def test_refused_on_the_reference_backend() -> None:
    with pytest.raises(ValueError, match="cpu and triton"):
        get_ops("torch", batch_invariant=True)


def test_triton_engine_rows_do_not_depend_on_the_batch(tmp_path, monkeypatch) -> None:
    """The CUDA path's wiring, under the interpreter: the engine on the Triton backend in the
    mode, bf16, a prompt alone and among four in chunked steps (prefill cut at 16 tokens)."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.testing import make_tiny_model
    from kernels import BACKEND_ENV

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    model = make_tiny_model(tmp_path / "tiny", hidden_size=60, num_heads=6, num_kv_heads=2,
                            head_dim=10, num_layers=1)
    prompts = [[*range(20, 40), 5], list(range(3, 12)), [7], [9, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    engine = LLMEngine(EngineConfig(model=str(model), attention_backend="triton",
                                    dtype="bfloat16", batch_invariant=True, num_kv_blocks=32,
                                    max_num_batched_tokens=16))
    batched = engine.generate(prompts, greedy)[0]
    alone = engine.generate(prompts[:1], greedy)[0]
    assert alone.token_ids == batched.token_ids
    assert alone.outputs[0].logprobs == batched.outputs[0].logprobs
