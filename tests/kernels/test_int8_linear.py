"""Weight-only int8: quantize/dequantize bounds, and the C kernel (both its paths), the CPU
dispatch and the Triton kernel (under the interpreter without CUDA) against
``kernels.int8.linear_reference`` on awkward shapes: 1, 3, 17 rows, K not a multiple of the
vector width, N not a multiple of the row tile, per-channel and per-32 scales."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import int8, native
from kernels.int8_triton import linear_int8 as linear_int8_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (N, K, group): K of 13 and 100 leave a scalar tail after the vectors; 1539 a long one; 8227
# more than the VNNI path's int32 lanes hold before they are flushed (8192); 96 and 576 with
# groups of 32 (Q8_0's); 80 with 16, smaller than an AVX-512 vector.
SHAPES = [(7, 13, None), (33, 100, None), (65, 96, 32), (130, 576, 32), (66, 1539, None),
          (9, 80, 16), (5, 8227, None)]
X16_MAX = 16383  # cpu_int8.c's fixed-point path: x rows as int16, each row's max magnitude at this


def _case(rows: int, n: int, k: int, group: int | None, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rows * 1000 + n + k)
    # Each output row's magnitude varies, so per-row and per-group scales really differ.
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    if group is not None:  # and each group's
        weight *= torch.rand(n, k // group, generator=gen).repeat_interleave(group, dim=1) + 0.1
    q, scale = int8.quantize(weight, group)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    return x, q, scale, bias


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                  x_rounding: torch.Tensor | None = None) -> None:
    # float32 accumulation in another order; bf16 outputs rounded once more; where x was
    # rounded to int16 (the VNNI path), at most that rounding's worst case on top.
    tol = (1e-5 if dtype == torch.float32 else 8e-3) * float(want.float().abs().max())
    extra = 0 if x_rounding is None else x_rounding
    assert bool(((got.float() - want.float()).abs() <= tol + extra).all()), (
        float((got.float() - want.float()).abs().max()), tol)


def _fixed_rounding(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   portable: bool) -> torch.Tensor | None:
    """The fixed-point path's bound where it runs (VNNI or AVX2; per-channel scales or groups of
    32, not forced portable): each x rounded by at most half of its row's max / X16_MAX, times
    the weights' magnitudes."""
    group = q.shape[1] // scale.shape[1]
    if (portable or group not in (q.shape[1], 32)
            or not native.library("cpu_int8").linear_int8_has_fixed()):
        return None
    half_step = x.float().abs().amax(1, keepdim=True) / X16_MAX / 2  # [M, 1]
    return half_step * int8.dequantize(q, scale).abs().sum(1)[None, :] * (1 + 1e-3)


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_round_trip_is_within_half_a_step(n: int, k: int, group: int | None) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen) * 3
    q, scale = int8.quantize(weight, group)
    g = k if group is None else group
    assert q.dtype == torch.int8 and scale.shape == (n, k // g)
    step = scale.repeat_interleave(g, dim=1)
    error = (int8.dequantize(q, scale) - weight).abs()
    assert bool((error <= step / 2 * (1 + 1e-6)).all())
    # each group's largest magnitude is exactly +-127 (the scale is not wasted), never -128
    assert torch.equal(q.reshape(n, -1, g).abs().amax(-1), torch.full((n, k // g), 127,
                                                                        dtype=torch.int8))
    assert int(q.min()) >= -127


def test_a_zero_group_quantizes_to_zero() -> None:
    weight = torch.randn(3, 64)
    weight[1, 32:] = 0
    q, scale = int8.quantize(weight, 32)
    assert float(scale[1, 1]) == 0.0 and not q[1, 32:].any()
    assert torch.equal(int8.dequantize(q, scale)[1, 32:], torch.zeros(32))


@pytest.mark.parametrize("group", [32, None], ids=["g32", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantizing_a_chunk_of_rows_at_a_time_gives_the_whole_result(
        monkeypatch: pytest.MonkeyPatch, group: int | None, dtype: torch.dtype) -> None:
    # 23 rows 4 at a time (the last chunk 3), the rows' own scales each, into the caller's
    # tensors; the weight itself is left as it was.
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(23, 64, generator=gen) * torch.rand(23, 1, generator=gen)).to(dtype)
    weight[5] = 0  # an all-zero row inside a chunk
    original = weight.clone()
    g = 64 if group is None else group
    w = weight.float().reshape(23, -1, g)
    want_scale = w.abs().amax(-1) / int8.QMAX
    want_q = torch.round(w / torch.where(want_scale > 0, want_scale, 1)[..., None]).reshape(23, 64)
    monkeypatch.setattr(int8, "QUANTIZE_CHUNK_BYTES", 4 * 4 * 64)
    out = (torch.full((23, 64), 99, dtype=torch.int8), torch.full((23, 64 // g), -1.0))
    q, scale = int8.quantize(weight, group, out=out)
    assert q is out[0] and scale is out[1]
    assert torch.equal(scale, want_scale) and torch.equal(q, want_q.to(torch.int8))
    assert torch.equal(weight, original)
    with pytest.raises(ValueError, match="quantize's out"):
        int8.quantize(weight, group, out=(q[:, :32], scale))


def test_scales_that_do_not_divide_k_are_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        int8.quantize(torch.randn(4, 100), 32)
    q, _ = int8.quantize(torch.randn(4, 96), 32)
    with pytest.raises(ValueError, match="do not divide"):  # 5 scales a row of 96
        native.linear_int8_rows(torch.randn(1, 96), q, torch.ones(4, 5))


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_c_kernel_matches_the_reference(rows: int, n: int, k: int, group: int | None,
                                        dtype: torch.dtype, portable: bool) -> None:
    x, q, scale, bias = _case(rows, n, k, group)
    x = x.to(dtype)
    want = int8.linear_reference(x, q, scale, bias)
    got = native.linear_int8_rows(x, q, scale, bias, portable=portable)
    assert got.dtype == dtype and got.shape == (rows, n)
    rounding = _fixed_rounding(x, q, scale, portable)
    _assert_close(got, want, dtype, rounding)
    # without the bias too (a NULL pointer in C)
    _assert_close(native.linear_int8_rows(x, q, scale, portable=portable),
                  int8.linear_reference(x, q, scale), dtype, rounding)


def test_the_build_has_the_avx512_paths_where_the_cpu_does() -> None:
    # Otherwise the "native" cases above test the portable path twice.
    lib, flags = native.library("cpu_int8"), native._cpu_flags().split()
    assert bool(lib.linear_int8_has_avx512()) == ("avx512f" in flags)
    vnni = "avx512_vnni" in flags and "avx512bw" in flags
    assert bool(lib.linear_int8_has_vnni()) == vnni
    assert bool(lib.linear_int8_has_fixed()) == (vnni or {"avx2", "fma"} <= set(flags))
    # (where the OS grants the tiles, as cpu_linear.c's AMX path asks)
    granted = bool(native.library("cpu_linear").linear_has_amx()) or "amx_bf16" not in flags
    assert bool(lib.linear_int8_has_amx()) == (
        vnni and {"amx_tile", "amx_int8"} <= set(flags) and granted)
    # the packed GEMM where the fixed point is AVX2's
    assert bool(lib.linear_int8_has_packed()) == (not vnni and {"avx2", "fma"} <= set(flags))


def _fixed_point_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    """cpu_int8.c's per-channel fixed point, step by step: each x row scaled to X16_MAX and
    rounded half away from zero (roundf), the exact integer sum of x * q, rounded to float32
    once, times x's scale, then the channel's, plus the bias, in x's dtype."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    xs = torch.where(amax > 0, amax / X16_MAX, torch.ones_like(amax))
    v = (xf * (1.0 / xs)).abs()
    whole = v.floor()  # roundf: half away from zero (floor(v + 0.5) rounds 0.49999997 up)
    xq = (torch.sign(xf) * (whole + (v - whole >= 0.5))).to(torch.int64)
    exact = xq @ q.to(torch.int64).T
    return ((exact.to(torch.float32) * xs) * scale.T + bias).to(x.dtype)


def _c_linear(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor, out_dtype: torch.dtype, path: int) -> torch.Tensor:
    """cpu_int8.c's linear_int8 of per-channel weights called straight (a build of the test's
    choosing, y in any dtype), on 2 threads."""
    out = torch.empty(x.shape[0], q.shape[0], dtype=out_dtype)
    lib.linear_int8(x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr(), scale.data_ptr(),
                    bias.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16),
                    x.shape[0], q.shape[0], q.shape[1], q.shape[1], path, 2)
    return out


# (N, K): 16 and 64 one AMX block and step; 48 by 64 whole blocks and steps past the first
# (their outputs stored as one run); 100 and 1539 inputs past the last 64 (36 of them a step of
# 32 and 4 more, and 3); 130 and 17 rows past the last block of 16; 8227 past the VNNI lanes'
# 8192; 70000 past AMX's 65536.
@pytest.mark.parametrize(("n", "k"), [(16, 64), (48, 64), (33, 100), (130, 1539), (17, 8227),
                                      (16, 70000)])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])  # 17: two x tiles on AMX; 40: a second pass
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tiles", [False, True], ids=["best", "tiles"])
def test_per_channel_fixed_point_sums_exactly_and_rounds_once(
        n: int, k: int, rows: int, dtype: torch.dtype, tiles: bool) -> None:
    # Bit for bit, so AVX2's, VNNI's, AMX's and the packed GEMM's paths agree, whichever a row
    # count takes.
    if not native.library("cpu_int8").linear_int8_has_fixed():
        pytest.skip("no fixed-point path in this build")
    x, q, scale, bias = _case(rows, n, k, None)
    x = x.to(dtype)
    assert torch.equal(native.linear_int8_rows(x, q, scale, bias, tiles=tiles),
                       _fixed_point_product(x, q, scale, bias))


# 12-16: the packed GEMM's last tile of 5 x rows 2, 3, 4, none and 1 rows; 33, 80 and 200: the
# columns' vectors part-filled, in passes of 48 and 32, and of 64, 48, 48 and 40; 1030: past
# the 1024 rows a call takes at once
@pytest.mark.parametrize("rows", [12, 13, 14, 15, 16, 33, 80, 200, 1030])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_channel_rows_in_any_tile_and_chunk_sum_exactly(rows: int,
                                                            dtype: torch.dtype) -> None:
    if not native.library("cpu_int8").linear_int8_has_fixed():
        pytest.skip("no fixed-point path in this build")
    x, q, scale, bias = _case(rows, 130, 1539, None)
    x = x.to(dtype)
    want = _fixed_point_product(x.float(), q, scale, bias)
    assert torch.equal(native.linear_int8_rows(x, q, scale, bias), want.to(dtype))
    # y in the other dtype (each chunk of rows finds its place in y by y's own)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    out = _c_linear(native.library("cpu_int8"), x, q, scale, bias, other, native.INT8_PATH_BEST)
    assert torch.equal(out, want.to(other))


def test_which_kernel_a_per_channel_call_takes() -> None:
    # The same bits whichever runs (above), so only this shows which a call takes: AMX's tiles
    # from 8 rows where the build has them, the packed GEMM from 12 where it has that, the
    # columns from 32 with VNNI (and AMX's tiles first where the process may use them).
    lib = native.library("cpu_int8")
    amx, packed = bool(lib.linear_int8_has_amx()), bool(lib.linear_int8_has_packed())
    columns = bool(lib.linear_int8_has_columns())
    def kernel(m: int, k: int, g: int, path: int) -> int:
        return lib.linear_int8_kernel(ctypes.c_int64(m), ctypes.c_int64(k), ctypes.c_int64(g),
                                      ctypes.c_int(path))  # restype: int, ctypes' default
    tiles = native.INT8_KERNEL_TILES
    wide = native.INT8_KERNEL_AMX if amx else native.INT8_KERNEL_PACKED if packed else (
        native.INT8_KERNEL_COLUMNS if columns else tiles)
    from_ = 8 if amx else 12 if packed else 32
    rows = (1, 7, 8, 11, 12, 31, 32, 600)
    assert [kernel(m, 2048, 2048, native.INT8_PATH_BEST) for m in rows] == [
        wide if m >= from_ else tiles for m in rows]
    assert kernel(64, 2048, 32, native.INT8_PATH_BEST) == tiles  # groups of 32: the tiles
    assert kernel(64, 2048, 2048, native.INT8_PATH_TILES) == tiles
    assert kernel(64, 2048, 2048, native.INT8_PATH_PORTABLE) == tiles


@pytest.mark.parametrize("weight", [127, -128])
@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("tiles", [False, True], ids=["best", "tiles"])
def test_per_channel_sums_at_their_largest_stay_exact(weight: int, rows: int,
                                                      tiles: bool) -> None:
    # Every x at X16_MAX (AMX's hi byte 63, lo 255) by every weight at an end of int8, over
    # 70000 inputs: the VNNI and AVX2 lanes (and the packed GEMM's) at their fullest over a
    # flush, AMX's lo sums past 2^31 without its store every 65536 inputs, and 256 * hi past
    # 2^31 unless taken as int64.
    if not native.library("cpu_int8").linear_int8_has_fixed():
        pytest.skip("no fixed-point path in this build")
    k = 70000
    x, q = torch.ones(rows, k), torch.full((32, k), weight, dtype=torch.int8)
    x[1] = -1.0
    scale, bias = torch.full((32, 1), 1e-3), torch.zeros(32)
    got = native.linear_int8_rows(x, q, scale, bias, tiles=tiles)
    assert torch.equal(got, _fixed_point_product(x, q, scale, bias))
    assert got[0, 0] == pytest.approx(k * weight * 1e-3, rel=1e-6)


@pytest.mark.skipif("avx2" not in native._cpu_flags().split(), reason="needs AVX2")
@pytest.mark.parametrize("path", ["best", "tiles"])
def test_an_avx2_build_gives_the_same_bits_per_channel(path: str) -> None:
    # The AVX2 build's fixed point (its packed GEMM at 40 rows, or its tiles of 8 lanes of
    # vpmaddwd) against this CPU's own (VNNI's 16 lanes, AMX's tiles): the int64 sums make them
    # the same bits.
    haswell = native.library("cpu_int8", march="haswell")
    x, q, scale, bias = _case(40, 130, 1539, None)
    x = x.to(torch.bfloat16)
    out = _c_linear(haswell, x, q, scale, bias, torch.bfloat16,
                    native.INT8_PATH_BEST if path == "best" else native.INT8_PATH_TILES)
    assert torch.equal(out, native.linear_int8_rows(x, q, scale, bias))


@pytest.mark.parametrize("group", [None, 32], ids=["channel", "g32"])
def test_fixed_point_path_is_closer_than_the_weights_rounding(group: int | None) -> None:
    # x as int16 adds far less error than int8 weights: against the float model's product,
    # the kernel's error is within 1% more than the reference's (which only rounds weights).
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(64, 576, generator=gen), torch.randn(3, 576, generator=gen)
    q, scale = int8.quantize(weight, group)
    exact = x.double() @ weight.double().T
    ref_error = (int8.linear_reference(x, q, scale).double() - exact).abs().mean()
    got_error = (native.linear_int8_rows(x, q, scale).double() - exact).abs().mean()
    assert got_error <= ref_error * 1.01


# past linear_int8_max_rows (8; per channel 512 on AMX, every count on the packed AVX2 GEMM,
# 1024 on VNNI's columns; 32 in groups of 32 on the fixed-point path): dequantize + GEMM
@pytest.mark.parametrize("rows", [1, 8, 9, 32, 33, 40, 64, 65, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [32, None], ids=["g32", "channel"])
def test_cpu_dispatch_matches_the_reference(rows: int, dtype: torch.dtype,
                                            group: int | None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    x, q, scale, bias = _case(rows, 130, 576, group)
    x = x.to(dtype)
    in_kernel = rows <= native.linear_int8_max_rows(group or 0)
    kernel_rows: list[int] = []
    rows_kernel = native.linear_int8_rows
    monkeypatch.setattr(native, "linear_int8_rows", lambda x, *a, **kw: (
        kernel_rows.append(x.shape[0]), rows_kernel(x, *a, **kw))[1])
    rounding = _fixed_rounding(x, q, scale, False) if in_kernel else None
    _assert_close(native.linear_int8(x, q, scale, bias), int8.linear_reference(x, q, scale, bias),
                  dtype, rounding)
    assert kernel_rows == ([rows] if in_kernel else [])


def test_the_fixed_point_path_takes_the_kernel_further() -> None:
    # The fixed-point path (VNNI's or AVX2's) beats dequantize + GEMM per channel to 512 rows on
    # AMX's tiles, every count on the packed AVX2 GEMM, 1024 on VNNI's columns (it has one of
    # the two), and to 32 in groups of 32 (kernels/native.py); other groups and the other paths
    # to 8.
    lib = native.library("cpu_int8")
    fixed = bool(lib.linear_int8_has_fixed())
    assert fixed == bool(lib.linear_int8_has_packed() or lib.linear_int8_has_columns())
    assert native.linear_int8_max_rows(0) == (
        512 if lib.linear_int8_has_amx() else native.LINEAR_INT8_MAX_ROWS_PACKED
        if lib.linear_int8_has_packed() else 1024 if lib.linear_int8_has_columns() else 8)
    assert native.linear_int8_max_rows(32) == (32 if fixed else 8)
    assert native.linear_int8_max_rows(16) == 8


@pytest.mark.parametrize("x_first", [False, True], ids=["y-transposed", "y-columns"])
@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-gemm", "widened"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [32, None], ids=["g32", "channel"])
def test_past_the_c_rows_the_weight_is_dequantized_a_chunk_at_a_time(
        monkeypatch: pytest.MonkeyPatch, native_bf16: bool, dtype: torch.dtype,
        group: int | None, x_first: bool) -> None:
    # 130 output rows made 24 at a time (the last chunk 10) into one buffer per dtype (a bf16
    # chunk is dequantized through the float32 one), reused by the next call; each chunk's
    # rows take their own scales. y transposed, or (float32 chunks from CHUNKED_X_FIRST_FROM
    # rows, here every count) a chunk's columns at a time.
    chunk_dtype = torch.float32 if dtype == torch.float32 or not native_bf16 else dtype
    if x_first and chunk_dtype != torch.float32:
        pytest.skip("bf16 chunks make y transposed at every row count: the case beside this")
    monkeypatch.setattr(native, "WIDEN_CHUNK_BYTES", 24 * chunk_dtype.itemsize * 576)
    monkeypatch.setattr(native, "CHUNKED_X_FIRST_FROM", 1 if x_first else 1 << 40)
    monkeypatch.setattr(native, "_scratch", native.threading.local())
    monkeypatch.setattr(native, "cpu_has_native_bf16", lambda: native_bf16)
    x, q, scale, bias = _case(20, 130, 576, group)
    x = x.to(dtype).view(2, 10, 576)
    out = native.linear_int8(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (2, 10, 130) and out.is_contiguous()
    want = int8.linear_reference(x.view(20, 576), q, scale, bias).view(2, 10, 130)
    _assert_close(out, want, dtype if chunk_dtype == dtype else torch.float32)
    buffers = {dt: b.data_ptr() for dt, b in native._scratch.buffers.items()}
    assert set(buffers) == {chunk_dtype, torch.float32}
    assert native._scratch.buffers[chunk_dtype].numel() == 24 * 576
    native.linear_int8(x[0], q[:50], scale[:50])
    assert {dt: b.data_ptr() for dt, b in native._scratch.buffers.items()} == buffers  # reused


# K: steps of 32 and a tail; past a 4-step unroll, leftover steps, one K_CHUNK flush, a tail;
# groups of 32 in pairs with one left over (8288), and in pairs only (8320)
@pytest.mark.parametrize(("k", "group"), [(100, None), (8293, None), (8288, 32), (8320, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_does_not_depend_on_the_others(k: int, group: int | None,
                                             dtype: torch.dtype) -> None:
    # One order of reduction per output whatever the rows: the batch-invariant mode's linear.
    # A lone row takes its own loop on the fixed-point path (row_fixed): the same bits, from
    # float32 rows and from bf16 ones.
    x, q, scale, bias = _case(17, 65, k, group)
    x = x.to(dtype)
    alone = torch.cat([native.linear_int8_rows(x[i : i + 1], q, scale, bias) for i in range(17)])
    assert torch.equal(native.linear_int8_rows(x, q, scale, bias), alone)


@pytest.mark.parametrize("weight", [127, -128], ids=["127", "-128"])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_int32_lanes_hold_a_whole_chunk_at_its_largest(weight: int, rows: int) -> None:
    # Every x at its row's largest magnitude (X16_MAX in fixed point) times the largest weights
    # (-128 too: a GGUF's Q8_0 may hold it) over K_CHUNK inputs and one step more: the most an
    # int32 lane holds before its flush (on AVX2, 1024 products a lane). Exact in float32.
    k = 8192 + 32
    q = torch.full((5, k), weight, dtype=torch.int8)
    x = torch.ones(rows, k)
    got = native.linear_int8_rows(x, q, torch.ones(5, 1))
    assert torch.equal(got, torch.full((rows, 5), float(weight * k)))


def test_the_reference_is_the_dequantized_product() -> None:
    # The spec itself, against float64 on the dequantized weights written out by hand.
    x, q, scale, bias = _case(3, 9, 80, 16)
    w = q.double() * scale.double().repeat_interleave(16, dim=1)
    want = x.double() @ w.T + bias.double()
    torch.testing.assert_close(int8.linear_reference(x, q, scale, bias).double(), want,
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "group"), [(7, 13, None), (65, 96, 32), (33, 100, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_matches_the_reference(rows: int, n: int, k: int, group: int | None,
                                             dtype: torch.dtype) -> None:
    x, q, scale, bias = _case(rows, n, k, group)
    x = x.to(dtype)
    want = int8.linear_reference(x, q, scale, bias)
    got = linear_int8_triton(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    assert got.dtype == dtype and got.shape == (rows, n)
    _assert_close(got.cpu(), want, dtype)


def test_the_triton_backend_runs_the_int8_kernel(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The CUDA path's wiring, under the interpreter: the engine on the Triton backend with int8
    # weights multiplies through this kernel and gives the torch reference path's tokens.
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.testing import make_tiny_model
    from kernels import BACKEND_ENV, int8_triton

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    model = make_tiny_model(tmp_path / "tiny", hidden_size=32, intermediate_size=64,
                            num_heads=2, num_kv_heads=1, num_layers=1)
    launches = 0
    kernel = int8_triton._linear_int8_kernel

    class Counted:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            nonlocal launches
            launches += 1
            return kernel[grid]

    monkeypatch.setattr(int8_triton, "_linear_int8_kernel", Counted())
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        engine = LLMEngine(EngineConfig(model=str(model), attention_backend=backend,
                                        quantization="int8", dtype="float32", num_kv_blocks=16))
        tokens[backend] = [o.token_ids for o in engine.generate([[5, 6, 7], [9]], greedy)]
    assert tokens["triton"] == tokens["torch"]
    assert launches >= 4 * 3  # every projection of every step (warm-up steps too)
