"""``kernels.native.linear`` against a float64 product of the same (widened) values, on
awkward shapes: K not a multiple of the vector width, N not a multiple of the row block."""

from __future__ import annotations

import pytest
import torch

from kernels import native


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


SHAPES = [(1, 13), (7, 64), (1001, 576), (66, 1539)]


# The C kernel's two entries whatever linear_max_rows says: linear_small (the default mode's;
# bf16 rows by bf16 weights from COLUMNS_FROM rows take the columns where it has them) and
# linear_fixed (the batch-invariant mode's tiles at every row count).
KERNELS = {"dispatch": native.linear, "fixed": native.linear_rows,
           "small": lambda x, w, b: native._linear_c("linear_small", x, w, b)}


# past linear_max_rows, torch's GEMM: with AVX512-BF16 72 rows in float32, 100 in bf16; with
# AVX-512's packed GEMM 260 (past its 128 and 256). A packed GEMM takes every count from 24 to
# its limit (every count with AVX2's): 25 and 26 end on tiles of 1 and 2 rows, 33 on one of 3
# with AVX2's 6-row tiles, of 9 with AVX-512's 12.
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 20, 25, 26, 33, 40, 72, 100, 260])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_linear_matches_the_exact_product(rows: int, n: int, k: int, dtype: torch.dtype,
                                          with_bias: bool, kernel: str) -> None:
    # The tiles: a lone row's stream; 2 and 3 rows in 2-row tiles; 7, 8, 9 and 40 in 4-row tiles
    # and what is left, 7 in one of each kind, 72 in a chunk of 64 rows and one of 8; on AMX, 20
    # rows in x tiles of 16 and 4, 40 in a pass of 32 and one of 8. The columns: 33 rows in three
    # vectors (15 lanes empty), 40 in three, 72 in passes of 48 and 24, 100 of 64 and 36; N past
    # the last whole tile (n = 1001, 66: 24 accumulators by 2, 3 or 4 vectors), K odd (13, 1539).
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    out = KERNELS[kernel](x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = _reference(x, weight, bias)
    # float32 accumulation over k terms, then the output rounded to its dtype.
    tol = (1e-5 if dtype == torch.float32 else 8e-3) * float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0)


def _bf16_and_float32_outputs(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> dict[torch.dtype, torch.Tensor]:
    """The C kernel's outputs of the same bf16 rows and weights, asked for in each dtype."""
    (rows, k), n = x.shape, weight.shape[0]
    outs = {dtype: torch.empty(rows, n, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, out in outs.items():
        native.library("cpu_linear").linear_small(
            x.data_ptr(), 1, weight.data_ptr(), 1, None if bias is None else bias.data_ptr(),
            out.data_ptr(), int(dtype == torch.bfloat16), rows, n, k, 2)
    return outs


@pytest.mark.parametrize("rows", [1, 20, 40])
# On AMX, k = 64 stores 16 outputs at once, k = 1539 one at a time (inputs past the last 32);
# n = 64 reads x in bf16 only, n = 50 has two weight rows past the tiles. 40 rows: the columns
# where the build has them.
@pytest.mark.parametrize(("n", "k"), [(64, 64), (50, 64), (50, 1539)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_bf16_outputs_are_the_float32_sums_rounded(rows: int, n: int, k: int,
                                                   with_bias: bool) -> None:
    # The same bf16 rows and weights, the outputs asked for in float32 and in bf16: the bf16
    # ones are the float32 ones rounded to nearest even, bit for bit (as torch rounds).
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) if with_bias else None
    outs = _bf16_and_float32_outputs(x, weight, bias)
    assert torch.equal(outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16))
    expected = _reference(x, weight, bias)
    torch.testing.assert_close(outs[torch.float32].double(), expected,
                               atol=1e-5 * float(expected.abs().max()), rtol=0)


COLUMNS_FROM = native.library("cpu_linear").linear_columns_from()  # 0: none in this build


def _float32_sums(function: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float32 outputs of cpu_linear.c's ``function`` (linear_small or linear_fixed) for
    bf16 rows by bf16 weights: every bit of each sum, not only a bf16 rounding's."""
    out = torch.empty(x.shape[0], weight.shape[0])
    getattr(native.library("cpu_linear"), function)(
        x.data_ptr(), 1, weight.data_ptr(), 1, None, out.data_ptr(), 0, x.shape[0],
        weight.shape[0], x.shape[1], 2)
    return out


@pytest.mark.skipif(COLUMNS_FROM == 0 or bool(native.library("cpu_linear").linear_has_amx()),
                    reason="no columns in this build, or AMX's tiles take bf16 rows first")
@pytest.mark.parametrize(("n", "k"), [(1001, 576), (66, 1539)])
def test_many_bf16_rows_take_the_columns(n: int, k: int) -> None:
    # From COLUMNS_FROM rows linear_small adds each output's pairs in K's order, one x row a
    # lane: a row's sums are the same in any batch of that many rows or more, at any lane of any
    # pass, and differ from the tiles' (the batch-invariant mode's order), which fewer rows take.
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(100, k, generator=gen).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)

    def small(rows: slice) -> torch.Tensor:
        return _float32_sums("linear_small", x[rows], weight)

    batch = small(slice(0, 100))  # passes of 64 and 36 rows
    assert torch.equal(small(slice(0, COLUMNS_FROM)), batch[:COLUMNS_FROM])
    assert torch.equal(small(slice(37, 37 + COLUMNS_FROM)), batch[37:37 + COLUMNS_FROM])
    assert torch.equal(small(slice(50, 100)), batch[50:])  # 50 rows: 4 vectors, 14 lanes empty
    many = torch.cat([x, x.flip(0)[:60]])  # 160 rows: passes of 64, 48 and 48
    assert torch.equal(_float32_sums("linear_small", many, weight)[100:], batch.flip(0)[:60])
    fewer = slice(0, COLUMNS_FROM - 1)
    assert torch.equal(small(fewer), _float32_sums("linear_fixed", x[fewer], weight))
    assert not torch.equal(batch, _float32_sums("linear_fixed", x, weight))  # orders differ


PACKED_FROM = native.library("cpu_linear").linear_packed_from()  # 0: none in this build
_FLAGS = native._cpu_flags().split()
# Builds of the packed GEMM this CPU runs, by -march: this CPU's own (where it has the GEMM),
# AVX2's (8 floats a vector) and AVX-512's without the bf16 dot product (16), so that an AVX-512
# host tests both whatever its own build takes.
PACKED_BUILDS = [march for march, needs in (
    ("native", PACKED_FROM > 0), ("haswell", {"avx2", "fma"} <= set(_FLAGS)),
    ("skylake-avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= set(_FLAGS)),
) if needs]


def test_without_the_columns_both_entries_are_the_tiles() -> None:
    # Float32 weights (and bf16 ones where the build has no columns, or AMX takes them) go through
    # the same kernel from linear_small and linear_fixed at any row count below the packed GEMM's.
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32] + ([torch.bfloat16] if COLUMNS_FROM == 0 or native.library(
        "cpu_linear").linear_has_amx() else [])
    for dtype in dtypes:
        x = torch.randn(PACKED_FROM - 1 if PACKED_FROM else 72, 576, generator=gen).to(dtype)
        weight = torch.randn(130, 576, generator=gen).to(dtype)
        assert torch.equal(native._linear_c("linear_small", x, weight, None),
                           native.linear_rows(x, weight))


def _sums_in_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each output's products added one after another in K's order, from 0, in float32 (exact
    products: bf16 values)."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]  # exact
    sums = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        sums += products[:, :, k]
    return sums


@pytest.mark.skipif(not PACKED_BUILDS, reason="no packed GEMM this CPU runs (AVX2 or AVX-512)")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32-x", "bf16-x"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32-w", "bf16-w"])
@pytest.mark.parametrize("march", PACKED_BUILDS)
def test_many_rows_take_the_packed_gemm(x_dtype: torch.dtype, w_dtype: torch.dtype,
                                        march: str) -> None:
    # From PACKED_FROM rows linear_small adds each output's products in K's order, one weight
    # row a lane, PACKED_K inputs packed at a time (K = 605: with AVX2 runs of 256, 256 and 88,
    # with AVX-512 four of 128 and one of 88, and 5 inputs past the last 8; 37 weight rows: two
    # blocks of 16 and one of 5, or one of 32 and one of 5), PACKED_M x rows a tile (6 or 12; 41
    # rows end on a tile of 5, and every count to 13 past PACKED_FROM on every last tile's size).
    # Bf16 values, so every product is exact and the sums in that order are known bit for bit;
    # the outputs in float32 (from float32 or bf16 rows), then the same rounded to bf16 with the
    # bias added. AVX2's build and AVX-512's get the same bits.
    lib = native.library("cpu_linear", march=march)
    packed_from = lib.linear_packed_from()
    assert packed_from > 0
    gen = torch.Generator().manual_seed(17)
    scale = 2.0 ** torch.randint(-10, 10, (41, 605), generator=gen)  # orders show in the sums
    x = (torch.randn(41, 605, generator=gen) * scale).to(torch.bfloat16).to(x_dtype)
    weight = torch.randn(37, 605, generator=gen).to(torch.bfloat16).to(w_dtype)
    bias = torch.randn(37, generator=gen)
    sums = _sums_in_order(x, weight)
    counts = [slice(0, rows) for rows in range(packed_from, min(41, packed_from + 14))]
    for rows in (slice(0, 41), slice(13, 13 + packed_from), *counts):
        out = torch.empty(rows.stop - rows.start, 37)  # float32 sums of x_dtype rows
        lib.linear_small(
            x[rows].data_ptr(), int(x_dtype == torch.bfloat16), weight.data_ptr(),
            int(w_dtype == torch.bfloat16), None, out.data_ptr(), 0, out.shape[0], 37, 605, 2)
        assert torch.equal(out, sums[rows]), f"{rows.stop - rows.start} rows"
    if march != "native":
        return  # the rest through kernels.native, which takes this CPU's build
    out = native._linear_c("linear_small", x.to(torch.bfloat16), weight, bias)
    assert torch.equal(out, (sums + bias).to(torch.bfloat16))
    fewer = x[: PACKED_FROM - 1]  # the tiles: another order
    assert torch.equal(native._linear_c("linear_small", fewer, weight, None),
                       native.linear_rows(fewer, weight))
    assert not torch.equal(native.linear_rows(x.float(), weight), sums)


def test_the_build_has_the_packed_gemm_where_the_cpu_has_no_bf16_dot_product() -> None:
    # Otherwise an AVX2 host, or an AVX-512 one without AVX512-BF16, would test the tiles where
    # users get the packed GEMM.
    assert (PACKED_FROM > 0) == ({"avx2", "fma"} <= set(_FLAGS) and "avx512_bf16" not in _FLAGS)


@pytest.mark.parametrize("rows", [3, 30])  # 30: a packed GEMM where the build has one
def test_bf16_outputs_keep_infinities_and_nans(rows: int) -> None:
    # A row with an infinite input gives infinities of its weights' signs, one with a NaN NaNs.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    x[0, 5], x[1, 9] = float("inf"), float("nan")
    weight = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    outs = _bf16_and_float32_outputs(x, weight, None)
    out = outs[torch.bfloat16].float()
    assert torch.equal(out[0], weight[:, 5].float().sign() * float("inf"))
    assert out[1].isnan().all() and out[2:].isfinite().all()
    assert torch.equal(out[2:], outs[torch.float32][2:].to(torch.bfloat16).float())


@pytest.mark.parametrize("k", [64, 1539])
def test_bf16_ties_round_to_even(k: int) -> None:
    # 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between two bf16 values: to even, 1 and 1 + 2^-6.
    x = torch.zeros(2, k, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    x[0, 1], x[1, 1] = 2.0**-8, 3 * 2.0**-8
    weight = torch.zeros(32, k, dtype=torch.bfloat16)
    weight[:, :2] = 1.0
    out = native.linear_rows(x, weight)
    assert out[0].tolist() == [1.0] * 32 and out[1].tolist() == [1.0 + 2.0**-6] * 32


def test_strided_rows_are_read_as_rows() -> None:
    # The o_proj input is a reshaped view; a column slice is not contiguous.
    x = torch.randn(3, 100)[:, 10:74]
    weight = torch.randn(20, 64)
    torch.testing.assert_close(native.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_float32_rows_by_bf16_weights(rows: int) -> None:
    # Widened as read even where the CPU has AVX512-BF16 (its dot product would round x).
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen)
    weight = torch.randn(37, 200, generator=gen).to(torch.bfloat16)
    out = native.linear(x, weight)
    assert out.dtype == torch.float32
    expected = _reference(x, weight, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * float(expected.abs().max()),
                               rtol=0)


@pytest.mark.filterwarnings("error::UserWarning")  # torch.mm resizing its out= included
@pytest.mark.parametrize("x_first", [False, True], ids=["y-transposed", "y-columns"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32-x", "bf16-x"])
def test_widened_in_chunks_through_one_buffer(monkeypatch: pytest.MonkeyPatch,
                                              x_dtype: torch.dtype, x_first: bool) -> None:
    # Past the C kernel's rows, bf16 weights on a CPU without bf16 arithmetic are widened a
    # few rows at a time (here 66 rows of 1539 inputs in chunks of 21: the last one of 3) into one
    # buffer the next call reuses; batched rows (3-d) come back in their own shape. y is made
    # transposed, a chunk's rows at a time, or from CHUNKED_X_FIRST_FROM rows (here 40 and 41:
    # x's 40 rows at the limit and one short of it) a chunk's columns at a time.
    monkeypatch.setattr(native, "WIDEN_CHUNK_BYTES", 21 * 4 * 1539)
    monkeypatch.setattr(native, "CHUNKED_X_FIRST_FROM", 40 if x_first else 41)
    firsts: list[int] = []  # each product's first operand's rows: x's 40, or a chunk's
    mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        firsts.append(a.shape[0])
        return mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", spy)
    monkeypatch.setattr(native, "_scratch", native.threading.local())
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 20, 1539, generator=gen).to(x_dtype)
    weight = torch.randn(66, 1539, generator=gen).to(torch.bfloat16)
    bias = torch.randn(66, generator=gen)
    out = native._linear_widened(x, weight, bias)
    assert out.dtype == x_dtype and out.shape == (2, 20, 66) and out.is_contiguous()
    expected = _reference(x.reshape(40, 1539), weight, bias).view(2, 20, 66)
    tol = (1e-5 if x_dtype == torch.float32 else 8e-3) * float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0)
    assert firsts == ([40] * 4 if x_first else [21, 21, 21, 3])
    buffer = native._scratch.buffers[torch.float32]
    assert buffer.numel() == 21 * 1539
    native._linear_widened(x[:1], weight[:30], None)
    assert native._scratch.buffers[torch.float32].data_ptr() == buffer.data_ptr()  # reused


@pytest.mark.parametrize("rows", [1, 7, 9, 31])
def test_widened_rows_off_a_multiple_of_eight(rows: int) -> None:
    # torch's GEMM gets x padded to a multiple of GEMM_ROW_ALIGN rows; only x's own rows come
    # back, each the product of its own row.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    out = native._linear_widened(x, weight, None)
    assert out.shape == (rows, 40) and out.is_contiguous()
    expected = _reference(x, weight, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * float(expected.abs().max()),
                               rtol=0)


def test_the_buffer_made_in_inference_mode_serves_outside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine's step (inference mode) makes the thread's buffer; a later call outside
    # inference mode updates it in place.
    monkeypatch.setattr(native, "_scratch", native.threading.local())
    weight = torch.randn(30, 64).to(torch.bfloat16)
    x = torch.randn(12, 64)
    with torch.inference_mode():
        inside = native._linear_widened(x, weight, None)
    outside = native._linear_widened(x, weight, None)
    assert torch.equal(inside, outside)
    torch.testing.assert_close(outside, x @ weight.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("flags", "amx"), [("flags : avx512f amx_bf16 amx_tile", True),
                                            ("flags : avx512f avx512_bf16", False)])
def test_bf16_rows_take_the_c_kernel_while_it_beats_torch(
        monkeypatch: pytest.MonkeyPatch, flags: str, amx: bool) -> None:
    # bench/RESULTS.md: on AMX's tiles the kernel beats torch's GEMM to 32 rows (one pass); with the
    # dot product only, torch's GEMM on AMX wins past 5 rows, and without AMX the kernel is taken to
    # 96 (a Zen 4 EPYC: on the columns from 32 rows it won to 96, tied from 128). float32 weights
    # take the kernel to 64 rows with AVX-512 (the same EPYC) and to 32 with AVX2; bf16 weights
    # widened (no dot product) to 24 (an AVX2 Zen 3 EPYC). With AVX2's packed GEMM, both take it
    # at every row count (the same Zen 3: it beat torch's GEMM from 24 rows to a prefill's); with
    # AVX-512's, float32 to 128 and bf16 to 256 (a Xeon without AVX512-BF16).
    lib = native.library("cpu_linear")  # before the flags change: they key its build
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    native.linear_max_rows.cache_clear()
    try:
        dot, tiles = bool(lib.linear_has_bf16_dot()), bool(lib.linear_has_amx())
        avx2 = lib.linear_vector_floats() == 8
        packed = {torch.bfloat16: native.EVERY_ROW_COUNT if avx2 else 256,
                  torch.float32: native.EVERY_ROW_COUNT if avx2 else 128} if PACKED_FROM else {}
        assert native.cpu_has_amx() is amx
        assert native.linear_max_rows(torch.bfloat16) == packed.get(torch.bfloat16, (
            32 if dot and tiles else 5 if dot and amx else 96 if dot else 24))
        assert native.linear_max_rows(torch.float32) == packed.get(torch.float32, (
            32 if avx2 else 64))
    finally:
        native.linear_max_rows.cache_clear()


def test_the_build_has_the_amx_path_where_the_cpu_does() -> None:
    # Otherwise the bf16 cases above test the dot product's tiles twice on an AMX host.
    flags = native._cpu_flags().split()
    assert bool(native.library("cpu_linear").linear_has_amx()) == (
        "amx_bf16" in flags and "amx_tile" in flags)
