"""The integer kernels of K-quant weights (ops/csrc/int8dot.h): activations rounded to int8 per 256 (llama.cpp's
Q8_K), products summed in integers. Checked against float64 products of gguf-py's dequantised weights with the
activations rounded to Q8_K here in numpy (the spec: d = max|x| / 127, q = nearest(x * 127 / max|x|)), and
against the exact float64 product within the bound that rounding allows."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, quants as gguf_quants

from deltaserve.models import packed
from deltaserve.models.layers import linear
from deltaserve.ops import fused
from tests.models.test_packed_weights import assert_matmul, packed_matrix
from tests.models.test_q8_weights import q8_0_rounded
from tests.builds import run_in_build, run_with
from tests.loader.test_quants import F16_FIELDS, random_blocks

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not build here")

# types of 32-weight blocks round activations per 32: test_32_weight_blocks, test_q8_0_rows_beside_k_quants
BLOCK32 = sorted(packed.int8_types() & {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL})
INT8 = sorted(packed.int8_types() - set(BLOCK32))  # the K-quants and IQ4_XS


def q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 rounded per 256: (x as float64 from its int8 codes, the step d per element)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 256)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv)
    d = (amax / np.float32(127)).astype(np.float64)
    return (torch.from_numpy((q * d).reshape(x.shape)), torch.from_numpy(np.broadcast_to(d, xb.shape).reshape(x.shape)))


def assert_int8_matmul(y, x, ref):
    """y is x @ ref^T with x rounded to Q8_K, up to float32 rounding of the block sums (and of y to y's dtype);
    and within half a step of every activation (times |W|) of the exact product."""
    x = x.reshape(-1, x.shape[-1]).float()
    xq, step = q8k(x)
    rounding = 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0
    y = y.double().reshape(x.shape[0], -1)
    # the kernels sum a 16-weight group's codes times its scale, then subtract its offset (Q3_K's 4 scale, Q2_K's
    # min): float32 terms up to twice the group's largest |w| even where w is 0 (an outlier activation shows it)
    group = ref.abs().reshape(ref.shape[0], -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(ref.shape)
    bound = 1e-5 * (xq.abs() @ (ref.abs() + 2 * group).T) + rounding * y.abs() + 1e-30
    err = (y - xq @ ref.T).abs()
    assert torch.all(err <= bound), f"worst error {float((err / bound).max()):.2f}x the bound"
    exact = (y - x.double() @ ref.T).abs()
    assert torch.all(exact <= 0.5 * step @ ref.abs().T + bound)


def run(x, w):
    y = torch.empty(x.shape[0], w.packing.shape[0])
    fused.extension().linear_int8(x.contiguous(), w, w.packing.table, y)
    return y


PANELS = [pytest.param(False, id="file-rows"), pytest.param(True, id="panels")]


# decode (up to 8 activation rows; 4 in the AVX2 build): rows at a time, or 16-row panels 4 activation rows a pass
# with the last out_rows % 16 rows at a time; on AVX-512 the same kernels take up to 16 rows, 8 at a time (11: 8 and
# 3); above, weight rows in tiles of 16 (AVX-512 VNNI: 10 activation rows a pass, so 61 leaves one)
@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 11, 16, 17, 40, 61], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("out_rows", [1, 37], ids=lambda n: f"out{n}")
@pytest.mark.parametrize("qtype", INT8, ids=lambda t: t.name)
def test_kernel_matches_q8k_reference(qtype, out_rows, rows, panels, prefill_path):
    K = 768  # three blocks
    w, ref = packed_matrix([(qtype, out_rows)], K, seed=rows + out_rows, panels=panels)
    x = torch.randn(rows, K) * torch.rand(rows, 1) * 4
    assert_int8_matmul(run(x, w), x, ref)


@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("rows", [1, 6, 11, 53], ids=lambda r: f"rows{r}")
def test_mixed_types_zero_rows_and_outliers(rows, panels, prefill_path):
    """A projection mixing the K-quants (llama.cpp's Q4_K_M keeps parts in Q6_K, Q3_K_M in Q4_K and Q5_K), rows of x
    that are zero (scale 0) and one with an outlier that takes all of its block's range."""
    K = 512
    segments = [(Q.Q6_K, 21), (Q.Q4_K, 35), (Q.Q3_K, 13), (Q.Q5_K, 19), (Q.Q2_K, 7), (Q.Q6_K, 9)] + \
        [(Q.IQ4_XS, 18)] * (Q.IQ4_XS in INT8)
    w, ref = packed_matrix(segments, K, seed=7, panels=panels)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x[min(2, rows - 1)] = 0
    x[-1, :256] = 0
    x[rows // 2, 100] = 1e4
    assert_int8_matmul(run(x, w), x, ref)


@pytest.mark.parametrize("rows", [3, 40], ids=lambda r: f"rows{r}")
def test_q4_k_largest_codes_and_activations_stay_exact(rows, prefill_path):
    """Q4_K's codes at 15, its 6-bit scales and mins at 63, activations at +-127 of their Q8_K step: the AVX2 prefill
    sums a sub-block's 8 steps of vpmaddubsw pairs in int16 (8 x 2 x 15 x 127 = 30,480, just inside), the other paths
    in their own ways; every output is then the largest such sum, each sign."""
    K, n = 512, 11
    block = np.zeros(144, dtype=np.uint8)  # d f16 | dmin f16 | scales[12] | qs[128]
    block[0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    block[4:] = 0xFF
    blocks = np.tile(block, (n * K // 256, 1))
    w = packed.parameter(torch.from_numpy(blocks.reshape(-1)), packed.Packing(((Q.Q4_K, n),), (n, K)))
    ref = torch.from_numpy(gguf_quants.dequantize(blocks.reshape(n, -1), Q.Q4_K).astype(np.float64))
    assert float(ref.max()) == pytest.approx(0.01 * 63 * 15 - 0.002 * 63, rel=1e-3)
    x = torch.ones(rows, K) * torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None]
    assert_int8_matmul(run(x, w), x, ref)


@pytest.mark.parametrize("rows", [1, 3, 40], ids=lambda r: f"rows{r}")
def test_iq4_xs_largest_levels_and_activations_stay_exact(rows, prefill_path):
    """IQ4_XS's level -127 (every nibble 0) at its largest scale (31), activations at +-127 of their Q8_K step: the
    AVX2 decode multiplies |x| by the level given x's sign, the prefill |level| by x given the level's sign; either
    way a pair of products is 2 x 127 x 127 = 32,258, inside int16, and every output the largest sum, each sign."""
    K, n = 512, 11
    block = np.zeros(136, dtype=np.uint8)  # d f16 | scales_h u16 | scales_l[4] | qs[128]
    block[0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    block[2:8] = 0xFF  # every scale (63 - 32)
    blocks = np.tile(block, (n * K // 256, 1))
    w = packed.parameter(torch.from_numpy(blocks.reshape(-1)), packed.Packing(((Q.IQ4_XS, n),), (n, K)))
    ref = torch.from_numpy(gguf_quants.dequantize(blocks.reshape(n, -1), Q.IQ4_XS).astype(np.float64))
    assert float(ref.min()) == float(ref.max()) == pytest.approx(0.01 * 31 * -127, rel=1e-3)
    x = torch.ones(rows, K) * torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None]
    assert_int8_matmul(run(x, w), x, ref)


@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("rows", [3, 11, 40], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("qtype", INT8, ids=lambda t: t.name)
def test_integer_sums_are_exact(qtype, rows, panels, prefill_path):
    """Every float scale 1 (the weights' float16 d and dmin; each block of x holds +-127, so its Q8_K step is 1):
    then every sum a kernel forms is an integer below 2^24, and y equals the float64 product exactly. One count off
    in any integer sum shows here, where the bounds above (1e-5 of the sum of |products|) are wider than a count:
    random codes and scales of both signs (Q3_K's and Q6_K's scales are signed), small activations."""
    K, n = 768, 37
    rng = np.random.default_rng(rows)
    blocks = random_blocks(qtype, n * K // 256, rng)
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = np.ones(blocks.shape[0], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks.reshape(n, -1), qtype).astype(np.float64))
    w = packed.parameter(torch.from_numpy(blocks.reshape(-1).copy()), packed.Packing(((qtype, n),), (n, K)))
    if panels:
        if not packed.panels_here():
            pytest.skip("this build's integer kernels read rows as the file holds them (no AVX-512)")
        w = packed.to_panels(w)
    x = rng.integers(-3, 4, size=(rows, K)).astype(np.float64)
    x[:, ::256] = 127 * rng.choice([-1, 1], size=(rows, K // 256))
    expected = torch.from_numpy(x) @ ref.T
    assert float(expected.abs().max()) < 2 ** 24
    y = run(torch.from_numpy(x).float(), w).double()
    assert torch.equal(y, expected), f"{int((y != expected).sum())} outputs off, by up to {float((y - expected).abs().max())}"


@pytest.mark.parametrize("panels", PANELS)
def test_a_call_after_others_gives_the_same_bits(panels, prefill_path):
    """The prefill keeps each thread's opened tiles from call to call (int8gemm.h gemm_panels): a call after others
    of other types, K and part-filled tiles gives the bits it gave before them."""
    gen = torch.Generator().manual_seed(3)
    a, ref_a = packed_matrix([(Q.Q4_K, 35), (Q.Q6_K, 9)], 1024, seed=11, panels=panels)
    b, ref_b = packed_matrix([(Q.Q3_K, 21), (Q.Q2_K, 19), (Q.Q5_K, 5)] + [(Q.IQ4_XS, 13)] * (Q.IQ4_XS in INT8), 768,
                             seed=12, panels=panels)
    x, xb = torch.randn(40, 1024, generator=gen), torch.randn(61, 768, generator=gen) * 4
    first = run(x, a)
    assert_int8_matmul(run(xb, b), xb, ref_b)
    again = run(x, a)
    assert torch.equal(first, again)
    assert_int8_matmul(again, x, ref_a)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("first", [Q.Q6_K, Q.Q4_0], ids=lambda t: t.name)
def test_decode_threads_split_mixed_rows_by_bytes(first, threads, panels):
    """Decode's threads take runs of equal bytes, not rows: 900 Q6_K rows (210 bytes a block) then 700 Q4_K rows (144)
    of K = 256 split at row 690 for 2 threads (460 and 929 for 3: inside a segment, inside a panel); every row is
    computed once, by the thread whose run holds its panel's first row. Q4_0 rows (144 bytes per 256, activations
    rounded per 32) before the Q4_K ones split where the rows do."""
    if first not in packed.int8_types():
        pytest.skip(f"{first.name} has no integer kernel in this build (AVX-512 VNNI or AVX2)")
    segments = [(first, 900), (Q.Q4_K, 700)]
    w, ref = packed_matrix(segments, 256, seed=13, panels=panels)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(threads))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = run(x, w)
    finally:
        torch.set_num_threads(before)
    if first == Q.Q6_K:
        assert_int8_matmul(y, x, ref)
        return
    y = y.double()
    xq8 = q8_0_rounded(x)  # the Q4_0 rows against activations rounded per 32, the Q4_K rows per 256
    assert torch.all((y[:, :900] - xq8 @ ref[:900].T).abs() <= 1e-5 * (xq8.abs() @ ref[:900].abs().T) + 1e-30)
    assert_int8_matmul(y[:, 900:], x, ref[900:])


@pytest.mark.skipif(not (fused.available() and fused.extension().q8_int8()),
                    reason="this build has no Q8_0 integer kernels (AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("segments, K, panels", [
    ([(Q.Q8_0, 21), (Q.Q4_K, 37), (Q.Q6_K, 5), (Q.Q8_0, 3), (Q.Q5_K, 16)], 512, False),
    ([(Q.Q8_0, 21), (Q.Q4_K, 37), (Q.Q6_K, 5), (Q.Q8_0, 3), (Q.Q5_K, 16)], 512, True),
    ([(Q.Q8_0, 21), (Q.Q8_0, 3)], 544, False),  # 17 blocks of 32: a lone block ends each row
])
def test_q8_0_rows_beside_k_quants(rows, segments, K, panels, prefill_path):
    """A projection of Q8_0 runs between K-quant rows (a MoE Q4_K_M file's attention inputs), as decode (up to 8
    activation rows) and prefill see it: the Q8_0 rows, read where they lie, take activations rounded per 32
    (llama.cpp's Q8_0), the others per 256 (Q8_K), each within float32 rounding of its own float64 reference."""
    w, ref = packed_matrix(segments, K, seed=11, panels=panels)
    assert packed.uses_int8(w)
    x = torch.randn(rows, K) * torch.rand(rows, 1) * 4
    y = linear(x, w).double()
    q8 = torch.cat([torch.full((n,), t == Q.Q8_0) for t, n in segments])
    xq8 = q8_0_rounded(x)
    bound = 1e-5 * (xq8.abs() @ ref[q8].abs().T) + 1e-30
    assert torch.all((y[:, q8] - xq8 @ ref[q8].T).abs() <= bound)
    if not q8.all():
        assert_int8_matmul(y[:, ~q8], x, ref[~q8])


@pytest.mark.skipif(not (fused.available() and fused.extension().q8_int8()),
                    reason="this build has no Q8_0 integer kernels (AVX-512 VNNI or AVX2)")
def test_a_short_tile_of_32_weight_blocks_ends_its_group(prefill_path):
    """Q8_0 rows 0..20 (a tile of 16, one of 5), K-quant rows 21..31, Q8_0 rows from 32: the third Q8_0 tile starts
    16 rows after the second, which is short; grouped with it, the second tile's unused columns would overwrite the
    K-quant rows (one thread, so that one thread takes all the tiles)."""
    segments = [(Q.Q8_0, 21), (Q.Q4_K, 11), (Q.Q8_0, 20)]
    w, ref = packed_matrix(segments, 512, seed=3)
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = linear(x, w).double()
    finally:
        torch.set_num_threads(threads)
    q8 = torch.cat([torch.full((n,), t == Q.Q8_0) for t, n in segments])
    xq8 = q8_0_rounded(x)
    assert torch.all((y[:, q8] - xq8 @ ref[q8].T).abs() <= 1e-5 * (xq8.abs() @ ref[q8].abs().T) + 1e-30)
    assert_int8_matmul(y[:, ~q8], x, ref[~q8])


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("qtype, panels",  # (of these types only Q4_0 rows go into panels)
                         [(t, False) for t in BLOCK32] + [(t, True) for t in BLOCK32 if t in packed.panel_types()],
                         ids=lambda v: v.name if isinstance(v, Q) else ("panels" if v else "file-rows"))
@pytest.mark.parametrize("out_rows", [37, 83], ids=lambda n: f"out{n}")  # AVX2 tiles of 32: 32 + 5 rows; 64 + 19
def test_32_weight_blocks(qtype, rows, out_rows, panels, prefill_path):
    """Q4_0, Q4_1, Q5_0, Q5_1 (and Q8_0; IQ4_NL in the AVX2 builds) matrices as decode (up to 8 activation rows)
    and prefill multiply them: activations rounded per 32 (llama.cpp's Q8_0), the _1 types' offsets times the
    rounded block sums; within float32 rounding of the float64 product of gguf-py's weights and the rounded
    activations. On AMX tiles the
    prefill takes 4 weight tiles at a time (83 rows: 4, then 2 with the last of 3). Q4_0 rows also in row panels
    (decode reads the panels, prefill the rows rebuilt from them; the last out_rows % 16 stay as in the file)."""
    K = 544  # 17 blocks: an odd one ends each row
    w, ref = packed_matrix([(qtype, out_rows)], K, seed=int(qtype) + rows, panels=panels)
    assert packed.uses_int8(w)
    x = torch.randn(rows, K) * torch.rand(rows, 1) * 4
    x[-1, :32] = 0  # a block of zeros: its scale 0
    y = linear(x, w).double()
    xq8 = q8_0_rounded(x)
    bound = 1e-5 * (xq8.abs() @ ref.abs().T) + 1e-30
    assert torch.all((y - xq8 @ ref.T).abs() <= bound)


def test_linear_takes_the_integer_kernels_and_can_be_told_not_to(monkeypatch):
    """packed.linear: K-quant matrices through the integer kernels (bf16 activations too, held column order);
    INT8_ACTIVATIONS = False gives the float32 product of the exact weights; a matrix with a type the integer
    kernels lack (MXFP4) stays on the float kernels."""
    K = 512
    order = torch.randperm(K, generator=torch.Generator().manual_seed(1))
    w, ref = packed_matrix([(Q.Q4_K, 21), (Q.Q6_K, 6)], K, seed=3, x_index=order)
    x = torch.randn(2, 5, K)
    y = linear(x, w)
    assert y.shape == (2, 5, 27)
    assert_int8_matmul(y, x[..., order], ref[:, order])
    xb = x.bfloat16()
    assert linear(xb, w).dtype == torch.bfloat16
    assert_int8_matmul(linear(xb, w), xb.float()[..., order], ref[:, order])
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", False)
    assert_matmul(linear(x, w), x[..., order], ref[:, order])
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", True)
    w2, ref2 = packed_matrix([(Q.Q4_K, 4), (Q.MXFP4, 3)], K, seed=4)
    assert_matmul(linear(x, w2), x, ref2)


@pytest.mark.parametrize("rows", [1, 5, 40], ids=lambda r: f"rows{r}")
def test_rows_apart_are_read_where_they_lie(rows, prefill_path):
    """x's rows may lie apart (the MLP's down projection reads swiglu's product, written over the gate half of
    gate_up, 2K floats a row): read in place, Q8_K and Q8_0 roundings alike; elements apart are refused by name."""
    K = 512
    segments = [(Q.Q4_K, 37), (Q.Q6_K, 5)] + [(t, 21) for t in BLOCK32[:1]]
    w, ref = packed_matrix(segments, K, seed=rows, panels=packed.panels_here())
    wide = torch.randn(rows, 2 * K) * 3
    x = wide[:, :K]  # rows 2K apart
    y = linear(x, w)
    assert torch.equal(y, run(x.contiguous(), w))
    q8 = torch.cat([torch.full((n,), t in BLOCK32) for t, n in segments])
    assert_int8_matmul(y[:, ~q8], x, ref[~q8])
    xq8 = q8_0_rounded(x)
    assert torch.all((y[:, q8].double() - xq8 @ ref[q8].T).abs() <= 1e-5 * (xq8.abs() @ ref[q8].abs().T) + 1e-30)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        fused.extension().linear_int8(wide[:, ::2], w, w.packing.table, torch.empty_like(y))


def test_bad_calls_are_named():
    w, _ = packed_matrix([(Q.MXFP4, 3)], 256, seed=1)
    with pytest.raises(RuntimeError, match="type 39 has no integer kernel"):
        run(torch.randn(2, 256), w)
    w, _ = packed_matrix([(Q.Q4_K, 3)], 256, seed=1)
    with pytest.raises(RuntimeError, match="float32 \\[M, K\\]"):
        run(torch.randn(2, 256).double(), w)


@pytest.mark.parametrize("march, needs", [("x86-64-v3", "avx512f"), ("alderlake", "avx_vnni"), ("x86-64-v2", "avx2")])
def test_avx2_build_of_the_kernels(march, needs):
    """On an AVX-512 machine the AVX2 paths (ymm, vpmaddwd; decode rows opened in registers by int8gemv_avx2.h, the
    32-weight blocks by int8legacy_avx2.h) are built for x86-64-v3, and with AVX-VNNI (vpdpwssd, vpdpbusd on ymm:
    Intel's client cores) for alderlake, and run the kernel tests above; so does the portable C++ (x86-64-v2: the
    K-quant rows opened into memory and summed in plain loops, int8dot.h dot_rows). (Not the whole models against
    llama.cpp: these tiny random models amplify summation order, and the AVX2 build's qwen35 run parts from
    llama.cpp's greedy text at token 16 with a top-2 margin of 6.6e-2 std, past the bound that the AVX-512 build,
    llama.cpp's own arithmetic here, meets.)"""
    run_in_build(__file__, march, "not build and not llama_cpp", needs=needs)


def test_panels_prefetching_into_the_other_cache():
    """The decode panels prefetch their runs into L1 on AMD CPUs and into L2 elsewhere (panel_gemv.h kPanelL1): two
    instantiations of every panel kernel, of which a CPU takes one. DELTASERVE_PANEL_PREFETCH runs the other here,
    through the panel tests above."""
    if not packed.panels_here() or "DELTASERVE_PANEL_PREFETCH" in os.environ:
        pytest.skip("no panel kernels in this build" if not packed.panels_here() else "already the other path's run")
    other = "l2" if "AuthenticAMD" in Path("/proc/cpuinfo").read_text() else "l1"
    run_with(__file__, "panels and (kernel_matches or decode_threads or 32_weight or mixed_types)",
             dict(os.environ, DELTASERVE_PANEL_PREFETCH=other))


def test_build_without_vnni():
    """Skylake-SP's AVX-512 (BW, no VNNI): K-quant and Q4_0 panels decoded through vpmaddubsw + vpmaddwd, the other
    rows of 32-weight blocks and every prefill through the rows' kernels (int8legacy_avx2.h): the kernel tests."""
    run_in_build(__file__, "skylake-avx512", "not build and not llama_cpp")


def test_build_without_vbmi():
    """Cascade Lake's AVX-512 (VNNI, no VBMI: the Xeons this project has run on) opens the 32-weight blocks with
    inserts where this CPU permutes bytes: the kernel tests of those types in that build."""
    run_in_build(__file__, "cascadelake", "32_weight or q8_0_rows or mixed_types", needs="avx512vbmi",
                 check="from deltaserve.ops import fused; assert fused.extension().q8_int8()")


# -- whole models against llama.cpp, which runs the same arithmetic on the same files ---------------------

@pytest.mark.parametrize("arch, quant, nearer, bound", [("qwen35", "Q4_K_M", 4, 5e-2), ("qwen35moe", "Q4_K_M", 4, 5e-2),
                                                        ("qwen35", "Q3_K_M", 4, 5e-2), ("qwen35", "Q2_K", 4, 5e-2),
                                                        ("qwen35", "Q4_0", 2, 5e-2), ("qwen35moe", "Q4_0", 2, 5e-2),
                                                        ("qwen35", "IQ4_NL", 1.5, 1e-1)])
def test_k_quant_model_matches_llama_cpp(arch, quant, nearer, bound, tmp_path, monkeypatch):
    """Last-token logits near llama.cpp's on a file its own quantiser wrote, much nearer than with float32
    activations: both engines round activations to Q8_K. These random tiny models amplify a single rounding
    that lands the other way at a tie: measured 3.7e-2 (qwen35) and 4.2e-2 (qwen35moe) max|diff|/std at this
    prompt, from 3e-5 to 4e-2 over its prefixes, where float32 activations are 0.23 and 0.39 away. 32 greedy
    tokens identical unless llama.cpp's own top-2 margin at the first difference is below that bound (5e-2 std;
    qwen35moe parts at token 25 with a margin of 3.5e-2). A Q4_0 file's activations are rounded per 32 (Q8_0), finer
    than per 256, so float32 ones are nearer there: 4.1e-2 against 0.12 (its row panels and the rows as the file
    holds them give the same bits). IQ4_NL (same rounding) sits further off at every prefix: 1.5e-2 to 7.7e-2
    (Q4_0's file 1.8e-2 to 4.1e-2) against 0.15-0.16 with float32 activations. Not a difference of arithmetic: llama.cpp's
    repacked iq4_nl_8x8 GEMM runs ours (an emulation of it in torch gives our logits exactly); its repacked and
    unrepacked paths are 7.3e-2 apart on this file, and ours is 3.0e-2 from the unrepacked one. A single activation
    code rounded the other way early grows into that gap here, so its bound is 1e-1 and 1.5x nearer."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from deltaserve.convert import make_model
    from deltaserve.engine.llm import LLM
    from tests.models.test_llama_cpp_parity import PROMPT, assert_greedy_agrees, llama, llama_last_logits, rel_diff

    path = make_model(arch, "tiny256", "f32", tmp_path / f"{arch}.gguf", seed=5, quantize=quant).gguf_path
    ours, ref = LLM(path, max_len=256, kv_dtype=torch.float32), llama(path)
    ids = ours.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # the prefill GEMM, then the decode GEMV below
    theirs = llama_last_logits(ref, ids)
    gap = rel_diff(ours.score(ids)[-1].double().numpy(), theirs)
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", False)
    float_gap = rel_diff(ours.score(ids)[-1].double().numpy(), theirs)
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", True)
    assert gap < bound and gap < float_gap / nearer, (gap, float_gap)
    assert_greedy_agrees(ours, ref, ids, 32)
    ref.close()
