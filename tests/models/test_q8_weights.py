"""The Q8_0 form of a weight (int8 + a float16 scale per 32): gguf-py's own blocks, and the same numbers as
float32 in linear() (float16 weights too) and embed_tokens(); with activations rounded per 32 to Q8_0 (the
integer kernels, as llama.cpp), the float64 product of the rounded activations. Whole models stored this way:
test_stored_weights.py."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from deltaserve.models import layers
from deltaserve.models.layers import dequantize, embed_tokens, linear, quantize_q8
from deltaserve.ops import fused
from tests.builds import run_in_build


def q8_values(N, K, seed=0):
    """float32 [N, K] holding exactly Q8_0 values, and gguf-py's blocks of them (f16 scale + 32 int8 each)."""
    x = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    x[1, :32] = 0  # an all-zero block: scale 0
    raw = gguf_quants.quantize(x, Q.Q8_0)
    w = gguf_quants.dequantize(raw, Q.Q8_0)
    return torch.from_numpy(w.copy()), raw.reshape(N, K // 32, 34)


def test_q8_form_is_gguf_blocks():
    w, blocks = q8_values(37, 96)
    p = quantize_q8(w, rows_per_pass=10)  # several slices
    assert p is not None and p.dtype == torch.int8 and p.scale.dtype == torch.float16
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    values = blocks[..., 2:].copy().view(np.int8).reshape(37, 96)
    np.testing.assert_array_equal(p.scale.numpy(), scales)
    np.testing.assert_array_equal(p.numpy(), values)
    assert torch.equal(dequantize(p, torch.float32), w)


@pytest.mark.parametrize("case", ["float16_values", "row_not_blocks", "nan"])
def test_values_not_in_q8_form_are_refused(case):
    w, _ = q8_values(8, 64)
    if case == "float16_values":
        w = torch.randn(8, 64).half().float()
    elif case == "row_not_blocks":
        w = w[:, :48].contiguous()
    else:
        w[3, 5] = float("nan")
    assert quantize_q8(w) is None


# the kernels up to 16 activation rows, then a GEMM, which widens blocks of 100 output rows here
@pytest.mark.parametrize("out_rows", [37, 2500], ids=lambda n: f"out{n}")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("form", ["q8_0", "float16"])
def test_linear_with_narrow_weight_matches_float64(form, rows, out_rows, monkeypatch):
    monkeypatch.setattr(layers, "_DEQUANT_BYTES", 100 * 96 * 4)
    monkeypatch.setattr(layers, "Q8_INT8_ACTIVATIONS", False)
    w, _ = q8_values(out_rows, 96, seed=1)
    if form == "q8_0":
        p = quantize_q8(w)
    else:
        p = w.half()
        w = p.float()
    bias = torch.randn(out_rows)
    x = torch.randn(2, rows, 96)
    expected = (x.double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(linear(x, p, bias), expected, rtol=1e-5, atol=1e-5)


def test_embedding_rows_of_a_q8_table():
    w, _ = q8_values(50, 64, seed=2)
    ids = torch.tensor([[3, 1, 49], [0, 3, 7]])
    assert torch.equal(embed_tokens(quantize_q8(w), ids, torch.float32), w[ids])


def q8_0_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as llama.cpp's quantize_row_q8_0 rounds it, in float64: per 32, d = max|x| / 127, q = nearest(x / d)
    (with the float32 d), values q * d with d kept as float16."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(xb * inv)
    return torch.from_numpy((q * d.astype(np.float16).astype(np.float64)).reshape(x.shape))


int8_kernels = pytest.mark.skipif(not (fused.available() and fused.extension().q8_int8()),
                                  reason="this build has no Q8_0 integer kernels (AVX-512 VNNI or AVX2)")


# decode: a row at a time for up to 8 activation rows (K = 96: a pair of blocks and one alone; 544: 8 pairs of a
# vector of 16 scales, then one alone; 1088: two such vectors of pairs and one of a pair); above, tiles of
# 16 weight rows (37 rows: two full, one of 5), on AMX tiles (16 activation rows a tile: 40 = two and 8; weight
# tiles 4 to a group: 37 rows = one group of 3) and on the AVX-512 registers
@int8_kernels
@pytest.mark.parametrize("K", [96, 544, 1088], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("out_rows", [1, 37], ids=lambda n: f"out{n}")
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40], ids=lambda r: f"rows{r}")
def test_int8_kernels_match_the_rounded_activations(rows, out_rows, K, prefill_path):
    w, _ = q8_values(max(out_rows, 2), K, seed=rows + K)
    w = w[:out_rows].contiguous()
    p = quantize_q8(w)
    gen = torch.Generator().manual_seed(1000 * rows + 10 * out_rows + K)
    x = torch.randn(rows, K, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    x[0, 32:64] = 0  # a block of zeros: scale 0
    if rows > 2:
        x[2, 5] = 1e4  # an outlier takes its block's whole range
    y = linear(x, p)
    xq = q8_0_rounded(x)
    expected = xq @ w.double().T
    bound = 1e-5 * (xq.abs() @ w.double().abs().T) + 1e-30
    err = (y.double() - expected).abs()
    assert torch.all(err <= bound), f"worst {float((err / bound).max()):.2f}x the bound"
    # and within half a step of every activation of the exact product, plus |q| <= 127 times the step's float16
    # rounding: a block whose largest |x| is below 127 float16 normals (0.0078) keeps few of its step's bits
    d = (np.abs(x.numpy()).reshape(rows, -1, 32).max(-1) / np.float32(127)).astype(np.float64)
    off = 0.5 * d + 127 * np.abs(d - d.astype(np.float16).astype(np.float64))
    off = torch.from_numpy(np.repeat(off, 32, axis=1))
    assert torch.all((y.double() - x.double() @ w.double().T).abs() <= off @ w.double().abs().T + bound)


@int8_kernels
@pytest.mark.parametrize("M, N, K", [(40, 37, 544), (17, 64, 96), (33, 200, 1024)], ids=str)
def test_amx_tiles_give_the_registers_bits(M, N, K):
    """The prefill on AMX tiles forms the same integer sums per block and the same float operations as the AVX-512
    path: the same bits, whatever the rows past a tile's 16 (M = 17, 33) and a last group of fewer than 4 weight
    tiles (N = 37: 3, the last of 5 rows; N = 200: 13 tiles, the last of 8)."""
    ext = fused.extension()
    if not ext.set_amx(True):
        pytest.skip("no AMX tiles here (a build without them, or Linux did not grant this process their state)")
    w, _ = q8_values(N, K, seed=M)
    p = quantize_q8(w)
    x = torch.randn(M, K) * 2
    tiles, registers = torch.empty(M, N), torch.empty(M, N)
    try:
        ext.linear_q8_int8(x, p, p.scale, tiles)
        ext.set_amx(False)
        ext.linear_q8_int8(x, p, p.scale, registers)
    finally:
        ext.set_amx(True)
    assert torch.equal(tiles, registers)


@int8_kernels
@pytest.mark.parametrize("rows", [1, 5, 40], ids=lambda r: f"rows{r}")
def test_int8_kernels_read_rows_apart_where_they_lie(rows, prefill_path):
    """Activation rows 2K floats apart (swiglu's product over the gate half of gate_up, the down projection's input)
    are read in place: the bits of the same rows made contiguous, within float32 rounding of the rounded product."""
    K = 544
    w, _ = q8_values(37, K, seed=rows)
    p = quantize_q8(w)
    x = (torch.randn(rows, 2 * K) * 3)[:, :K]
    y = linear(x, p)
    assert torch.equal(y, linear(x.contiguous(), p))
    xq = q8_0_rounded(x)
    assert torch.all((y.double() - xq @ w.double().T).abs() <= 1e-5 * (xq.abs() @ w.double().abs().T) + 1e-30)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        fused.extension().linear_q8_int8(torch.randn(rows, 2 * K)[:, ::2], p, p.scale, torch.empty(rows, 37))


@int8_kernels
def test_int8_kernel_calls_are_checked():
    p = quantize_q8(q8_values(4, 64)[0])
    with pytest.raises(RuntimeError, match="float32 \\[M, K\\]"):
        fused.extension().linear_q8_int8(torch.randn(2, 64).double(), p, p.scale, torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="scale must be float16"):
        fused.extension().linear_q8_int8(torch.randn(2, 64), p, p.scale.float(), torch.empty(2, 4))


@int8_kernels
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_q8_0_model_matches_llama_cpp(arch, tmp_path, monkeypatch):
    """A Q8_0 file: last-token logits nearer llama.cpp's with activations rounded to Q8_0 (its arithmetic on these
    files) than with float32 ones, and 32 greedy tokens identical unless llama.cpp's own top-2 margin at the first
    difference is below 5e-2 std (these tiny random models amplify a rounding that lands the other way at a tie)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import torch
    from deltaserve.convert import make_model
    from deltaserve.engine.llm import LLM
    from tests.models.test_llama_cpp_parity import PROMPT, assert_greedy_agrees, llama, llama_last_logits, rel_diff

    path = make_model(arch, "tiny", "q8_0", tmp_path / f"{arch}.gguf", seed=5).gguf_path
    ours, ref = LLM(path, max_len=256, kv_dtype=torch.float32), llama(path)
    assert ours.model.layers[0].mixer.out_proj.weight.dtype == torch.int8  # the file's Q8_0 kept
    ids = ours.tokenizer.encode(PROMPT)
    theirs = llama_last_logits(ref, ids)
    gap = rel_diff(ours.score(ids)[-1].double().numpy(), theirs)
    monkeypatch.setattr(layers, "Q8_INT8_ACTIVATIONS", False)
    float_gap = rel_diff(ours.score(ids)[-1].double().numpy(), theirs)
    monkeypatch.setattr(layers, "Q8_INT8_ACTIVATIONS", True)
    assert gap < 3e-2 and gap < float_gap, (gap, float_gap)
    assert_greedy_agrees(ours, ref, ids, 32)
    ref.close()


@pytest.mark.skipif(not fused.available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("K", [37, 50, 96, 200, 1000])  # tails of 5, 2 after a lone 16, 0, 8, 8
def test_float16_kernel_rows_do_not_depend_on_how_many_come_together(K):
    """Each activation row of linear_f16 is the float64 product within float32 summation's bound (K roundings of at
    most 2^-24 of the sum of |products|, as any order of float32 sums keeps; a fixed 1e-5 failed 2% of random draws
    at K = 1000 on AVX-512, 11% in the portable build), and bit for bit the row alone: a speculative verify pass (a
    few rows) then gives the plain decode step's (one row) logits, so greedy drafts are judged against exactly what
    plain decoding would pick."""
    g = torch.Generator().manual_seed(K)
    w = torch.randn(53, K, generator=g).half()
    x = torch.randn(13, K, generator=g)
    alone = torch.cat([_f16(x[m:m + 1], w) for m in range(13)])
    bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert torch.all((alone.double() - x.double() @ w.double().T).abs() <= bound)
    for M in (2, 3, 5, 8, 9, 13):  # up to 8 rows per pass over a weight row, then another pass
        assert torch.equal(_f16(x[:M], w), alone[:M]), M


@pytest.mark.skipif(not fused.available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_float16_kernel_in_other_builds(march):
    """The AVX2 decode GEMV (8 rows a block, F16C conversions) and the portable one (16 lanes) built for x86-64-v3 and
    -v2 (DELTASERVE_MARCH) pass the test above: the float64 product, and the same bits whatever rows come together."""
    run_in_build(__file__, march, "float16_kernel_rows")


@pytest.mark.skipif(not fused.available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_q8_0_int8_kernels_in_builds_without_vnni(march):
    """The Q8_0 integer kernels of CPUs without AVX-512 VNNI (int8legacy_avx2.h: AVX2, and Skylake-SP's AVX-512)
    pass the kernel tests above: the float64 product with the activations rounded as llama.cpp rounds them."""
    run_in_build(__file__, march, "int8_kernels_match or int8_kernel_calls")


def _f16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    fused.extension().linear_f16(x.contiguous(), w, y)
    return y
