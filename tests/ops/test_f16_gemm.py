"""The prefill GEMM of float16 weights (ops/csrc/f16gemm.h): float32 activations times the float16 weights as stored,
summed in float32. Checked against float64 products of the same values: exactly where every partial sum is exact in
float32, else within the bound of float32 summation; odd shapes cut every tile (rows of 6, columns of 64 and 256,
k of 16, 128 and 256) short."""

import pytest
import torch

from deltaserve.ops import fused
from tests.builds import run_in_build

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not build here")

U32 = 2.0 ** -24  # float32's unit roundoff


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))  # every output must be written
    fused.extension().linear_f16_gemm(x, w, y)
    return y


@pytest.mark.parametrize("K", [80, 1001, 1024, 3584], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("N", [33, 1000], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("M", [1, 17, 63, 257], ids=lambda m: f"M{m}")
def test_within_float32_summation_of_the_float64_product(M, N, K):
    """|y - x @ w| <= gamma_K * (|x| @ |w|): the bound of any order of K float32 multiply-adds (gamma_K = K u / (1 - K u))."""
    gen = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    x = torch.randn(M, K, generator=gen)
    w = (torch.randn(N, K, generator=gen) * 0.05).half()
    exact = x.double() @ w.double().T
    gamma = K * U32 / (1 - K * U32)
    bound = gamma * (x.double().abs() @ w.double().abs().T)
    err = (gemm(x, w).double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("M, N, K", [(13, 65, 1001), (257, 1000, 3584), (25, 300, 272)])
def test_exact_where_every_partial_sum_is(M, N, K):
    """Small integers times float16 values on a grid (normal and subnormal): every product and partial sum is a whole
    multiple of the grid step below 2^24 steps, so float32 sums them exactly and y equals the float64 product."""
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randint(-2, 3, (M, K), generator=gen).float()
    normal = torch.randint(-1024, 1025, (N, K), generator=gen) * 2.0 ** -14  # 11-bit integers: exact in float16
    subnormal = torch.randint(-1023, 1024, (N, K), generator=gen) * 2.0 ** -24  # float16's subnormal range
    for values in (normal, subnormal):
        w = values.half()
        assert torch.equal(w.double(), values.double())
        assert torch.equal(gemm(x, w).double(), x.double() @ values.double().T)


@pytest.mark.parametrize("M", [1, 17, 257], ids=lambda m: f"M{m}")
def test_rows_apart_are_read_where_they_lie(M):
    """x's rows 2K floats apart (swiglu's product over the gate half of gate_up, the down projection's input): within
    float32 summation of the float64 product, the bits of the same rows made contiguous; elements apart refused."""
    gen = torch.Generator().manual_seed(M)
    K = 1001
    x = torch.randn(M, 2 * K, generator=gen)[:, :K]
    w = (torch.randn(65, K, generator=gen) * 0.05).half()
    y = gemm(x, w)
    assert torch.equal(y, gemm(x.contiguous(), w))
    bound = K * U32 / (1 - K * U32) * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= bound).all())
    with pytest.raises(RuntimeError, match="contiguous rows"):
        gemm(torch.randn(M, 2 * K)[:, ::2], w)


def test_threads_split_the_outputs_without_changing_them():
    """Every output is summed in the same order whichever thread takes its unit: 1 and 3 threads (more threads
    than column blocks: the rows are split too) give the same bits, within the bound of the float64 product."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(131, 700, generator=gen), torch.randn(300, 700, generator=gen).half()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, w)
        torch.set_num_threads(3)
        three = gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)
    bound = 700 * U32 * 1.001 * (x.double().abs() @ w.double().abs().T)
    assert bool(((one.double() - x.double() @ w.double().T).abs() <= bound).all())


def test_more_rows_than_one_unit_sums_at_once():
    """1,100 rows: more than a unit sums in its own buffer (512 rows), so the rows are split into units too, with N a
    multiple of 1024 (y's rows alias in L1 there): the bits of the same rows taken 100 at a time, within the bound of
    the float64 product."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1100, 1000, generator=gen), (torch.randn(1024, 1000, generator=gen) * 0.05).half()
    y = gemm(x, w)
    assert torch.equal(y, torch.cat([gemm(x[i:i + 100], w) for i in range(0, 1100, 100)]))
    bound = 1000 * U32 * 1.001 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= bound).all())


def test_bad_arguments_are_named():
    run = fused.extension().linear_f16_gemm
    x, w, y = torch.randn(20, 48), torch.randn(10, 48).half(), torch.empty(20, 10)
    with pytest.raises(RuntimeError, match="x must be float32"):
        run(x.double(), w, y)
    with pytest.raises(RuntimeError, match="w must be float16 \\[N, K\\] contiguous, K as x's"):
        run(x, torch.randn(10, 47).half(), y)
    with pytest.raises(RuntimeError, match="w must be float16"):
        run(x, w.float(), y)
    with pytest.raises(RuntimeError, match="y must be float32 \\[M, N\\]"):
        run(x, w, torch.empty(20, 11))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["avx2", "portable"])
def test_other_builds_of_the_gemm(march):
    """On an AVX-512 machine the AVX2 path (ymm tiles of 6 x 16) and the portable C++ one (no AVX) are built for
    x86-64-v3 and -v2 (DELTASERVE_MARCH) and run the tests above."""
    run_in_build(__file__, march, "not other_builds")
