"""The C kernels built for a CPU without AVX (x86-64's baseline, SSE2): each builds, and the
linear, whose tiles pin vectors in registers that such a CPU lacks, gives the exact product."""

import platform

import pytest
import torch

from kernels import native

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="-march=x86-64 is x86's baseline")


@pytest.mark.parametrize("name", sorted(native.LIBRARIES))
def test_every_kernel_builds_without_avx(name: str) -> None:
    native.library(name, march="x86-64")


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_linear_without_avx_gives_the_exact_product(w_dtype: torch.dtype) -> None:
    lib = native.library("cpu_linear", march="x86-64")
    assert lib.linear_vector_floats() == 8 and not lib.linear_has_bf16_dot()
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 3, 9):  # a lone row's stream, 2-row tiles, 4-row tiles and the rest
        x = torch.randn(rows, 37, generator=gen)  # 37: whole steps of 8 and 16 and a tail
        w = torch.randn(11, 37, generator=gen).to(w_dtype)
        y = torch.empty(rows, 11)
        lib.linear_small(x.data_ptr(), 0, w.data_ptr(), int(w_dtype == torch.bfloat16), None,
                         y.data_ptr(), 0, rows, 11, 37, 1)
        exact = (x.double() @ w.double().T).float()
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5)
