"""The bfloat16-weight products (ops/csrc/bf16.h) against float64 products of the same bfloat16 weights: with the
activations rounded to bfloat16 (to nearest, ties to even, from their bits) where the build has AVX512_BF16
(vdpbf16ps) and the caller asks, else with the float32 activations themselves. The bound is float32 summation's
(K roundings of at most 2^-24 of the running |sum|), far below bfloat16's 2^-9 a rounding of the activations moves
a product, so each path is told apart from the other. The other ISAs' paths are built for older targets
(DELTASERVE_MARCH) and run these tests in a subprocess."""

import numpy as np
import pytest
import torch

from deltaserve.ops import fused
from tests.builds import run_in_build

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not build here")


def bf16_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to bfloat16 (to nearest, ties to even) from its bits, as float64 (finite x only)."""
    bits = x.contiguous().numpy().view(np.uint32).astype(np.uint64)
    kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return torch.from_numpy(kept.view(np.float32)).double()


def activations_read(x: torch.Tensor, round: bool = True) -> torch.Tensor:
    """x as the kernel multiplies it: bfloat16-rounded where asked on AVX512_BF16 builds, else float32."""
    return bf16_nearest_even(x) if round and fused.extension().bf16_rounds_activations() else x.double()


def run(x: torch.Tensor, w: torch.Tensor, round: bool = True) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    fused.extension().linear_bf16(x, w, y, round)
    return y


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, round: bool):
    xr, wd = activations_read(x, round), w.double()
    bound = x.shape[1] * 2.0 ** -23 * (xr.abs() @ wd.abs().T) + 1e-30
    err = (y.double() - xr @ wd.T).abs()
    assert torch.all(err <= bound), f"worst error {float((err / bound).max()):.2f}x the float32 summation bound"


@pytest.mark.parametrize("round", [True, False], ids=["rounded", "float32-activations"])
# 1031 and 4133: two blocks of k of the prefill panels (vdpbf16ps: 512 a block; AMX tiles: 4096), the last pair half
# empty
@pytest.mark.parametrize("K", [80, 1024, 1031, 4133])
@pytest.mark.parametrize("N", [33, 1000])
@pytest.mark.parametrize("M", [1, 3, 17, 63, 257])  # decode (<= 16 rows) and prefill, with edge tiles
def test_matches_float64_product(M, N, K, round, prefill_path):
    g = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # magnitudes over 6 decades
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    assert_product(run(x, w, round), x, w, round)


@pytest.mark.parametrize("M", [3, 17, 257])
@pytest.mark.parametrize("round", [True, False], ids=["rounded", "float32-activations"])
def test_rows_apart_are_read_where_they_lie(round, M, prefill_path):
    """x's rows 2K floats apart (swiglu's product over the gate half of gate_up, the down projection's input): the
    float64 product's bound and the bits of the same rows made contiguous; elements apart are refused by name."""
    K, g = 1031, torch.Generator().manual_seed(M)
    x = (torch.randn(M, 2 * K, generator=g) * 3)[:, :K]
    w = (torch.randn(70, K, generator=g) * 0.05).bfloat16()
    y = run(x, w, round)
    assert_product(y, x, w, round)
    assert torch.equal(y, run(x.contiguous(), w, round))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        run(torch.randn(M, 2 * K)[:, ::2], w, round)


@pytest.mark.parametrize("M", [1, 20], ids=["decode", "prefill"])
@pytest.mark.parametrize("round", [True, False], ids=["rounded", "float32-activations"])
def test_rounds_activations_to_nearest_even(round, M, prefill_path):
    """Hand-computed roundings through one-hot weight rows (y[m, n] = x[m, n] as the kernel reads it): ties go to the
    even neighbour, in the vector body (k < 64) and the scalar tail (k >= 64) alike; unrounded where not asked."""
    K = 80
    x = torch.ones(M, K)
    cases = {0: (1 + 2 ** -8, 1.0), 1: (1 + 3 * 2 ** -8, 1 + 2 ** -6), 2: (1 + 2 ** -8 + 2 ** -20, 1 + 2 ** -7),
             70: (1 + 2 ** -8, 1.0), 71: (-(1 + 3 * 2 ** -8), -(1 + 2 ** -6)), 72: (3.0, 3.0)}
    for k, (value, _) in cases.items():
        x[:, k] = value
    w = torch.zeros(len(cases), K, dtype=torch.bfloat16)
    for n, k in enumerate(cases):
        w[n, k] = 1.0
    y = run(x, w, round)[-1].tolist()
    rounds = round and fused.extension().bf16_rounds_activations()
    for n, (k, (value, rounded)) in enumerate(cases.items()):
        assert y[n] == (rounded if rounds else torch.tensor(value).item()), (k, value, y[n])


def test_large_and_tiny_weights_keep_their_values(prefill_path):
    """bfloat16 holds float32's range: 2^100 and 2^-120 (neither survives float16) multiply exactly."""
    w = torch.tensor([[2.0 ** 100, 0.0, 0.0], [0.0, 2.0 ** -120, 0.0], [0.0, 0.0, -3.0]], dtype=torch.bfloat16)
    x = torch.tensor([[2.0 ** -90, 2.0 ** 10, 0.5]]).repeat(40, 1)  # 40 rows: the prefill GEMMs too
    for round in (True, False):
        assert run(x, w, round).tolist() == [[2.0 ** 10, 2.0 ** -110, -1.5]] * 40


def test_isa_names_the_tiles_where_they_run():
    ext = fused.extension()
    for on in (False, True):
        enabled = ext.set_amx(on)
        assert enabled <= on  # turned off, the tiles never run
        assert ("tdpbf16ps" in ext.bf16_isa()) == enabled


def test_bad_arguments_are_named():
    ext, x = fused.extension(), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="w must be bfloat16"):
        ext.linear_bf16(x, torch.randn(3, 64), torch.empty(2, 3), True)
    with pytest.raises(RuntimeError, match="K as x's"):
        ext.linear_bf16(x, torch.randn(3, 65).bfloat16(), torch.empty(2, 3), True)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ext.linear_bf16(x.double(), torch.randn(3, 64).bfloat16(), torch.empty(2, 3), True)
    with pytest.raises(RuntimeError, match="y must be float32"):
        ext.linear_bf16(x, torch.randn(3, 64).bfloat16(), torch.empty(2, 4), True)


@pytest.mark.parametrize("march, path", [("x86-64-v3", "AVX2"), ("x86-64-v2", "portable")])
def test_other_isa_builds(march, path):
    """The widening paths of older targets (AVX2, portable C++; AVX-512's runs above, for float32 activations), built
    for them and run through the tests above (where rounding is asked for, they keep float32 activations)."""
    run_in_build(__file__, march, "not other_isa", needs="avx512_bf16",
                 check=f"from deltaserve.ops import fused; assert fused.extension().bf16_isa().startswith({path!r})")
