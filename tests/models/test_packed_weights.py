"""Weights kept in a file's GGML blocks (models/packed.py, ops/csrc/kquants.h, packed_gemv.h) against independent
references: gguf-py's dequantisers for the values, float64 matmuls for the products, and whole models quantised
by llama.cpp's own quantiser, run beside the same file loaded with float32 weights."""

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from deltaserve.models import layers, packed
from deltaserve.models.layers import dequantize, embed_tokens, linear, part
from deltaserve.ops import fused
from tests.loader.test_quants import random_blocks
from tests.builds import run_in_build

TYPES = sorted(packed.TYPES)


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """This file holds the float kernels (float32 activations, exact weights) to float32 accuracy; the integer
    kernels that K-quant matrices take by default are held to theirs in test_int8_dot.py (and Q8_0's, which an
    MXFP4_MOE file keeps beside its experts, in test_q8_weights.py)."""
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", False)
    monkeypatch.setattr(layers, "Q8_INT8_ACTIVATIONS", False)


def packed_matrix(segments, K, seed=0, x_index=None, panels=False):
    """A packed [N, K] matrix of random blocks (finite scales), rows in `segments` ((type, rows), ...), and its
    values from gguf-py as float64 (in held column order); panels: its K-quant (and Q4_0) rows moved into row panels
    (the test is skipped where the kernels read none)."""
    if panels and not packed.panels_here():
        pytest.skip("this build's integer kernels read rows as the file holds them (no AVX-512)")
    if panels and not {qtype for qtype, _ in segments} & packed.panel_types():
        pytest.skip("none of these types goes into panels in this build (IQ4_XS needs AVX-512 VNNI)")
    rng = np.random.default_rng(seed)
    raws, values = [], []
    for qtype, n in segments:
        blocks = random_blocks(qtype, n * K // GGML_QUANT_SIZES[qtype][0], rng)
        if qtype == Q.MXFP4:  # block exponents near 2^0 (random bytes reach 2^127: products overflow)
            blocks[:, 0] = rng.integers(118, 138, size=blocks.shape[0])
        raws.append(blocks.reshape(-1))
        values.append(gguf_quants.dequantize(blocks.reshape(n, -1), qtype).astype(np.float64))
    w = packed.parameter(torch.from_numpy(np.concatenate(raws)),
                         packed.Packing(tuple(segments), (sum(n for _, n in segments), K), x_index))
    ref = torch.from_numpy(np.concatenate(values))
    if panels:
        w = packed.to_panels(w)
        assert w.packing.panels
    return w, ref if x_index is None else ref[:, torch.argsort(x_index)]


def row_width(qtype):  # two blocks of 256, or three of 32: several blocks a row
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96


def assert_matmul(y, x, ref):
    """y == x @ ref^T up to float32 accumulation: within 1e-5 of the sum of |products| of each output."""
    x64 = x.double().reshape(-1, x.shape[-1])
    expected = x64 @ ref.T
    bound = 1e-5 * (x64.abs() @ ref.abs().T) + 1e-30
    err = (y.double().reshape(expected.shape) - expected).abs()
    assert torch.all(err <= bound), f"worst error {float((err / bound).max()):.2f}x the bound"


PANELS = [pytest.param(False, id="file-rows"), pytest.param(True, id="panels")]


@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_the_files_values(qtype, panels):
    """Rows as the file holds them, or (K-quants) 16 to a panel, the last 37 % 16 as they were."""
    if panels and qtype not in packed.panel_types():
        pytest.skip("only the K-quants, Q4_0 and (AVX-512 VNNI) IQ4_XS go into panels")
    w, ref = packed_matrix([(qtype, 37)], row_width(qtype), seed=int(qtype), panels=panels)
    assert torch.equal(dequantize(w, torch.float32).double(), ref)  # the C++ decoders, bit for bit
    ids = torch.tensor([[36, 0, 5], [5, 17, 36]])
    assert torch.equal(embed_tokens(w, ids, torch.float32).double(), ref[ids])


def test_mxfp4_every_exponent():
    """MXFP4's E8M0 block exponents, every byte (the subnormal halves of 0 and 1, the overflow of 255), bit for bit."""
    rng = np.random.default_rng(7)
    blocks = random_blocks(Q.MXFP4, 256 * 3, rng)
    blocks[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 3)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks.reshape(256, -1), Q.MXFP4).astype(np.float64))
    w = packed.parameter(torch.from_numpy(blocks.reshape(-1)), packed.Packing(((Q.MXFP4, 256),), (256, 96)))
    assert torch.equal(dequantize(w, torch.float32).double(), ref)


# the GEMV kernel up to 16 activation rows (8 per pass over a row: 9 and 16 take two), above them GEMMs on
# blocks of 64 dequantised rows (here: 150 output rows make three)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("out_rows", [1, 37, 150], ids=lambda n: f"out{n}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_matches_float64(qtype, out_rows, rows, monkeypatch):
    monkeypatch.setattr(packed, "_DEQUANT_BYTES", 1)
    K = row_width(qtype)
    w, ref = packed_matrix([(qtype, out_rows)], K, seed=rows, panels=qtype in packed.panel_types())
    x = torch.randn(rows, K)
    bias = torch.randn(out_rows)
    y = linear(x.view(1, rows, K), w, bias)
    assert y.shape == (1, rows, out_rows) and y.dtype == torch.float32
    assert_matmul(y - bias, x, ref)


@pytest.mark.parametrize("panels", PANELS)
@pytest.mark.parametrize("rows", [1, 5, 20], ids=lambda r: f"rows{r}")
def test_mixed_types_and_held_column_order(rows, panels):
    """A fused projection whose parts llama.cpp quantised differently, columns held in another order than the
    file's (Qwen3.5's tiled value heads): the segments and the gather of x must line up with the values."""
    K = 512
    order = torch.randperm(K, generator=torch.Generator().manual_seed(1))
    w, ref = packed_matrix([(Q.Q6_K, 21), (Q.Q4_K, 35), (Q.Q6_K, 3), (Q.IQ4_XS, 9), (Q.Q5_K, 17)], K, seed=2,
                           x_index=order, panels=panels)
    assert torch.equal(dequantize(w, torch.float32).double(), ref)
    x = torch.randn(rows, K)
    assert_matmul(linear(x, w), x, ref)


@pytest.mark.parametrize("rows", [1, 3, 9], ids=lambda r: f"rows{r}")
def test_mixed_types_with_offsets_and_small_blocks(rows):
    """Segments of every type in turn (offsets per 16, per 32, per block; blocks of 32 and 256) in one matrix: a
    row's visitor, and the per-32 sums of x that one activation row's offsets take, must follow the segments. The
    float kernels multiply such a matrix, so its Q4_K rows stay as the file holds them (no panels)."""
    K = 768
    order = torch.randperm(K, generator=torch.Generator().manual_seed(4))
    w, ref = packed_matrix([(Q.Q2_K, 7), (Q.Q4_1, 5), (Q.Q3_K, 11), (Q.Q5_1, 9), (Q.MXFP4, 4), (Q.Q5_0, 3),
                            (Q.Q4_K, 19), (Q.Q8_0, 6), (Q.Q2_K, 2)], K, seed=6, x_index=order)
    assert packed.to_panels(w) is w and not w.packing.panels
    assert torch.equal(dequantize(w, torch.float32).double(), ref)
    x = torch.randn(rows, K)
    assert_matmul(linear(x, w), x, ref)


@pytest.mark.parametrize("panels", PANELS)
def test_experts_are_parts_of_stacked_matrices(panels):
    K, n = 256, 3
    mats = [packed_matrix([(Q.Q4_K, 20), (Q.Q6_K, 17)], K, seed=e) for e in range(n)]
    stacked = packed.parameter(torch.stack([w.data for w, _ in mats]),
                               packed.Packing(mats[0][0].packing.segments, (n, 37, K)))
    if panels:
        if not packed.panels_here():
            pytest.skip("this build's integer kernels read rows as the file holds them (no AVX-512)")
        stacked = packed.to_panels(stacked)
    x = torch.randn(4, K)
    for e, (_, ref) in enumerate(mats):
        assert_matmul(linear(x, part(stacked, e)), x, ref)
    assert torch.equal(dequantize(stacked, torch.float32).double(), torch.stack([ref for _, ref in mats]))


@pytest.mark.parametrize("rows", [1, 20])
def test_without_the_cpp_kernels(rows, monkeypatch):
    """Where no compiler builds the kernels, the torch dequantisers stand in."""
    monkeypatch.setattr(fused, "available", lambda: False)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(3))
    w, ref = packed_matrix([(Q.Q5_K, 7), (Q.Q6_K, 4), (Q.Q3_K, 3), (Q.Q4_1, 2), (Q.MXFP4, 2), (Q.Q2_K, 3)], 512,
                           seed=4, x_index=order)
    x = torch.randn(rows, 512)
    assert_matmul(linear(x, w), x, ref)
    assert torch.equal(dequantize(w, torch.float32).double(), ref)


def test_bfloat16_activations_read_packed_weights():
    w, ref = packed_matrix([(Q.Q4_K, 37)], 256, seed=5)
    x = torch.randn(3, 256).bfloat16()
    y = linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.double() @ ref.T).float(), rtol=1e-2, atol=1e-2)


def test_avx2_build_of_the_kernels():
    """On an AVX-512 machine the AVX2 paths are built for x86-64-v3 (DELTASERVE_MARCH) and run the tests above."""
    run_in_build(__file__, "x86-64-v3", "rows_are or mixed or experts or every_exponent or (linear_matches and out37)",
                 check="from deltaserve.ops import fused; assert fused.available(), 'the AVX2 build failed'")


# -- whole models, quantised by llama.cpp ---------------------------------------------------------------

@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """quantised(arch, qtype) -> path of the tiny256 preset quantised by llama.cpp (each made once)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantises the test models")
    from deltaserve.convert import make_model

    root, cache = tmp_path_factory.mktemp("quantised"), {}

    def get(arch, qtype):
        if (arch, qtype) not in cache:
            cache[arch, qtype] = make_model(arch, "tiny256", "f32", root / f"{arch}-{qtype}.gguf", seed=5,
                                            quantize=qtype).gguf_path
        return cache[arch, qtype]
    return get


@pytest.mark.parametrize("arch, qtype", [("qwen35", "Q4_K_M"), ("qwen35moe", "Q4_K_M"), ("qwen3next", "IQ4_XS"),
                                         ("qwen35", "Q5_K_M"), ("qwen35", "Q4_0"), ("qwen35", "Q4_1"),
                                         ("qwen35", "Q5_0"), ("qwen35", "Q5_1"), ("qwen35", "Q2_K"),
                                         ("qwen35", "Q3_K_M"), ("qwen35moe", "MXFP4_MOE")])
def test_quantised_model_keeps_the_files_blocks(arch, qtype, quantised):
    """Loaded by default, every matmul weight of a type in packed.TYPES stays as the file's bytes (parameter
    bytes == tensor bytes; a Q8_0 tensor, as MXFP4_MOE keeps all but the experts, is held as int8 + scales)
    and the logits match the same file loaded with float32 weights: prefill (> 16 tokens: GEMMs on
    dequantised rows), decode (the GEMV) and greedy generation."""
    from deltaserve.engine.llm import LLM
    from deltaserve.loader import open_checkpoint
    from deltaserve.models.layers import Linear

    path = quantised(arch, qtype)
    kept = LLM(path, max_len=128, kv_dtype=torch.float32)
    f32 = LLM(path, max_len=128, weight_dtype=torch.float32, kv_dtype=torch.float32)
    model, ckpt = kept.model, open_checkpoint(path)
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)] + [model.embed.weight]
    weights += [p for n, p in model.named_parameters() if ".experts." in n]
    not_float = [w for w in weights if not w.is_floating_point()]  # the file's F32 routers stay floats
    kept_packed = [w for w in not_float if packed.is_packed(w)]
    q8 = any(ckpt.qtype(n) == Q.Q8_0 for n in ckpt.names())
    assert kept_packed and (q8 or len(kept_packed) == len(not_float))
    # every tensor of the file in a packed type, and no more, is held as its bytes; its Q8_0 tensors either as
    # rows of a packed projection (beside other types) or as int8 + a float16 scale per 32: 34 bytes a block
    packed_q8 = sum(math.prod(w.packing.shape[:-2]) * n * packed.row_bytes(t, w.packing.shape[-1])
                    for w in kept_packed for t, n in w.packing.segments if t == Q.Q8_0)
    int8_q8 = sum(w.nbytes + w.scale.nbytes for w in not_float if not packed.is_packed(w))
    file_bytes = {t: sum(ckpt.nbytes(n) for n in ckpt.names() if ckpt.qtype(n) == t) for t in packed.TYPES}
    assert sum(w.nbytes for w in kept_packed) == sum(file_bytes.values()) - file_bytes[Q.Q8_0] + packed_q8
    assert packed_q8 + int8_q8 == file_bytes[Q.Q8_0]
    if packed.is_packed(model.embed.weight):
        assert torch.equal(dequantize(model.embed.weight, torch.float32), ckpt.load("token_embd.weight"))

    text = "The river starts as a thin line of water high in the hills, and the stream grows loud."
    ids = kept.tokenizer.encode(text)
    assert len(ids) > 16
    torch.testing.assert_close(kept.score(ids), f32.score(ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kept.score(ids[:5]), f32.score(ids[:5]), rtol=1e-4, atol=1e-4)
    a = kept.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
    b = f32.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert a.token_ids == b.token_ids
    step_kept = kept.runner.forward([0], [[a.token_ids[-1]]])
    torch.testing.assert_close(step_kept, f32.runner.forward([0], [[b.token_ids[-1]]]), rtol=1e-4, atol=1e-4)
