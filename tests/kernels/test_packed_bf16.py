"""bf16 weights packed for the dot product (``kernels.native.pack_bf16``) and the C linear that
reads them (``cpu_linear.c``'s ``linear_packed_dot``): each output is its pairs of inputs added
in K's order, each pair's odd product then its even one (vdpbf16ps's definition), the same bits
for every row count and in every build (the dot product's and the portable C's)."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from kernels import native

_FLAGS = set(native._cpu_flags().split())
_LIB = native.library("cpu_linear")
# Builds this CPU runs: its own, and x86's baseline (SSE2: the portable sums, no dot product).
BUILDS = ["native"] + (["x86-64"] if platform.machine() in ("x86_64", "AMD64") else [])


def _sums_in_pair_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each output's products added in float32 one pair of inputs after another, the odd one
    first (bf16 values: every product exact)."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]
    sums = torch.zeros(x.shape[0], weight.shape[0])
    for j in range(x.shape[1] // 2):
        sums += products[:, :, 2 * j + 1]
        sums += products[:, :, 2 * j]
    return sums


def _packed_sums(lib: object, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The float32 outputs of ``lib``'s linear_small for bf16 rows by a packed weight."""
    n, k = native.packed_shape(packed)
    out = torch.empty(x.shape[0], n)
    lib.linear_small(x.data_ptr(), 1, packed.data_ptr(), 2, None,  # type: ignore[attr-defined]
                     out.data_ptr(), 0, x.shape[0], n, k, 2)
    return out


@pytest.mark.parametrize(("n", "k"), [(32, 2), (96, 62), (64, 576)])
def test_pack_and_unpack(n: int, k: int) -> None:
    # Block b, pair j, lane r holds inputs 2j and 2j + 1 of row 32b + r, the even one low.
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).bfloat16()
    packed = native.pack_bf16(weight.clone())
    assert packed.dtype == torch.int32 and packed.shape == (n // 32, k // 2, 32)
    inplace = weight.clone()
    assert native.pack_bf16(inplace).data_ptr() == inplace.data_ptr()  # the same memory
    assert torch.equal(inplace.view(torch.int32).view(packed.shape), packed)
    assert native.is_packed(packed) and not native.is_packed(weight)
    assert native.packed_shape(packed) == (n, k)
    bits = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    b, j, r = n // 32 - 1, k // 2 - 1, 5
    assert int(packed[b, j, r]) & 0xFFFF == int(bits[32 * b + r, 2 * j])
    assert (int(packed[b, j, r]) >> 16) & 0xFFFF == int(bits[32 * b + r, 2 * j + 1])
    assert torch.equal(native.unpack_bf16(packed), weight)


@pytest.mark.parametrize(("dtype", "shape"), [(torch.bfloat16, (48, 64)),
                                              (torch.bfloat16, (64, 63)),
                                              (torch.float32, (64, 64))])
def test_packing_takes_only_blocks_of_bf16_pairs(dtype: torch.dtype,
                                                 shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_bf16(torch.zeros(shape, dtype=dtype))
    with pytest.raises(ValueError, match="not contiguous"):  # it packs in place
        native.pack_bf16(torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64])


def test_what_packs() -> None:
    # the one rule pack_bf16 and LlamaForCausalLM.pack_weights both ask
    def bf16(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.bfloat16)

    assert native.packable(bf16(64, 2))
    assert not native.packable(bf16(48, 64))  # rows not whole blocks
    assert not native.packable(bf16(64, 63))  # an odd input
    assert not native.packable(bf16(64, 0))  # no inputs
    assert not native.packable(torch.zeros(64, 64))  # float32
    assert not native.packable(bf16(64, 128)[:, :64])  # not contiguous
    assert not native.packable(bf16(64 * 64))  # not a matrix


@pytest.mark.parametrize("march", BUILDS)
def test_packed_sums_are_in_pair_order_for_every_row_count(march: str) -> None:
    # 606 inputs: 303 pairs (not a multiple of 16); 64 weight rows: two blocks. Rows 1 to 8
    # read as they are, 9 to 12 in one packed tile, 13 to 27 in tiles of 6 to 12 split as evenly
    # as the rows allow, and 41 (four tiles of 10 and 11): each row's sums are the pair-order
    # sums, so the same whatever else is in the call.
    lib = native.library("cpu_linear", march=march)
    gen = torch.Generator().manual_seed(17)
    scale = 2.0 ** torch.randint(-10, 10, (41, 606), generator=gen)  # orders show in the sums
    x = (torch.randn(41, 606, generator=gen) * scale).to(torch.bfloat16)
    weight = torch.randn(64, 606, generator=gen).to(torch.bfloat16)
    packed = native.pack_bf16(weight.clone())
    sums = _sums_in_pair_order(x, weight)
    for rows in [*range(1, 28), 41]:
        assert torch.equal(_packed_sums(lib, x[:rows], packed), sums[:rows]), f"{rows} rows"
    assert torch.equal(_packed_sums(lib, x[30:31], packed), sums[30:31])  # a lone row, later
    even_first = torch.zeros_like(sums)
    products = x.float()[:, None, :] * weight.float()[None, :, :]
    for j in range(303):
        even_first += products[:, :, 2 * j]
        even_first += products[:, :, 2 * j + 1]
    assert not torch.equal(even_first, sums)  # the order shows in these sums


def test_a_prefill_of_several_chunks() -> None:
    # Past a chunk of tiles (linear_packed_chunk_tiles) the blocks pass again for the next one:
    # 8,192 inputs (a Llama MLP's down projection) and rows for three chunks, the last short,
    # each row's sums the pair-order sums (a skipped or repeated tile would show).
    k, n = 8192, 64
    chunk_rows = 12 * _LIB.linear_packed_chunk_tiles(ctypes.c_int64(k))
    rows = 2 * chunk_rows + 31
    assert 0 < chunk_rows < 1024  # several chunks at a size a test affords
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    packed = native.pack_bf16(weight.clone())
    xf, wf = x.float(), weight.float()
    sums = torch.zeros(rows, n)
    for j in range(k // 2):  # pair by pair, the odd product first, without [rows, n, k]
        sums += xf[:, 2 * j + 1, None] * wf[None, :, 2 * j + 1]
        sums += xf[:, 2 * j, None] * wf[None, :, 2 * j]
    assert torch.equal(_packed_sums(_LIB, x, packed), sums)


@pytest.mark.parametrize("rows", [1, 13, 40])
def test_through_linear_with_bias_and_bf16_outputs(rows: int) -> None:
    # kernels.native.linear and linear_rows (the batch-invariant mode's) take a packed weight at
    # any row count: the float32 sums plus the bias, rounded to bf16.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    weight = torch.randn(160, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(160, generator=gen)
    packed = native.pack_bf16(weight.clone())
    expected = (_sums_in_pair_order(x, weight) + bias).to(torch.bfloat16)
    assert torch.equal(native.linear(x, packed, bias), expected)
    assert torch.equal(native.linear_rows(x, packed, bias), expected)
    assert torch.equal(native.linear(x.view(1, rows, 96), packed, bias),
                       expected.view(1, rows, 160))
    with pytest.raises(TypeError, match="take bf16 rows"):
        native.linear(x.float(), packed)
    with pytest.raises(ValueError, match="rows of 48 inputs by a weight of 96"):
        native.linear(x.view(-1, 48), packed)  # as many values, not as many inputs


def test_an_unaligned_packed_weight() -> None:
    # a packed weight that does not start on a cache line (a view into a larger tensor)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    storage = torch.zeros(64 * 64 + 2, dtype=torch.bfloat16)
    shifted = storage[2:].view(64, 64)  # 4 bytes past the allocation's start
    shifted.copy_(weight)
    packed = native.pack_bf16(shifted)
    assert packed.data_ptr() % 64 != 0
    assert torch.equal(native.linear(x, packed), native.linear(x, native.pack_bf16(weight)))


@pytest.mark.skipif(not (_LIB.linear_columns_from() and not _LIB.linear_has_amx()),
                    reason="no columns in this build, or AMX's tiles take bf16 rows first")
def test_packed_sums_are_the_columns_sums() -> None:
    # From COLUMNS_FROM rows the unpacked weights take the columns, whose order is the same:
    # packing changes no output there (fewer rows take the dot tiles, another order).
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=gen).to(torch.bfloat16)
    weight = torch.randn(96, 576, generator=gen).to(torch.bfloat16)
    packed = native.pack_bf16(weight.clone())
    for rows in (_LIB.linear_columns_from(), 70):
        assert torch.equal(native.linear(x[:rows], packed), native.linear(x[:rows], weight))


def test_packed_where_the_build_has_the_dot_product_and_no_amx() -> None:
    expected = ({"avx512_bf16", "avx512f"} <= _FLAGS and not {"amx_tile", "amx_bf16"} & _FLAGS
                and bool(_LIB.linear_has_bf16_dot()))
    assert native.packs_bf16() == expected
