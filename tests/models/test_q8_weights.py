"""The Q8_0 form of a weight (int8 + a float16 scale per 32): gguf-py's own blocks, and the same numbers as
float32 in linear() (float16 weights too) and embed_tokens(). Whole models stored this way: test_stored_weights.py."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from deltaserve.models import layers
from deltaserve.models.layers import dequantize, embed_tokens, linear, quantize_q8


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
