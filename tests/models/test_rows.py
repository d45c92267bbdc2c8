"""Rows: checkpoint tensors stacked and split lazily, a block of rows at a time, hold the same values as
torch.cat / torch.split of the whole tensors read at once."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf import quants

from deltaserve.loader import open_checkpoint
from deltaserve.models.common import Rows, _store, dense, fetch_rows, stack_rows
from deltaserve.models.layers import dequantize, quantize_q8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A GGUF with a Q8_0 [70, 64] and an f16 [45, 64] matrix (odd row counts: blocks cut across them)."""
    path = tmp_path_factory.mktemp("rows") / "rows.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "qwen35")
    q8 = rng.standard_normal((70, 64)).astype(np.float32)
    writer.add_tensor("a.weight", quants.quantize(q8, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("b.weight", rng.standard_normal((45, 64)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return open_checkpoint(path)


def test_stack_and_split_match_cat(ckpt, monkeypatch):
    monkeypatch.setattr(Rows, "BLOCK", 16)
    a, b = ckpt.load("a.weight"), ckpt.load("b.weight")  # whole, the reference
    extra = torch.randn(3, 64)
    lazy_a, lazy_b = fetch_rows(ckpt, "a.weight", 70, 64), fetch_rows(ckpt, "b.weight", 45, 64)
    assert isinstance(lazy_a, Rows) and lazy_a.shape == (70, 64)
    head, tail = lazy_a.split([33, 37])
    stacked = stack_rows([tail, extra, lazy_b, head])
    expected = torch.cat([a[33:], extra, b, a[:33]])
    assert stacked.shape == tuple(expected.shape) and stacked.dim() == 2 and stacked.dtype == torch.float32
    for start, end in [(0, 200), (30, 40), (36, 41), (0, 0), (84, 86), (100, 118), (117, 400)]:
        assert torch.equal(stacked[start:end], expected[start:end]), (start, end)
    blocks = list(stacked.blocks())
    assert [r for r, _ in blocks] == list(range(0, len(expected), 16))
    assert torch.equal(torch.cat([blk for _, blk in blocks]), expected)
    assert torch.equal(dense(stacked), expected)
    # what the loader makes of it: the same stored values as from the whole tensor
    assert torch.equal(_store(stacked, torch.float16, "cpu").float(), expected.half().float())
    q8 = quantize_q8(stack_rows([lazy_a, a]))
    assert torch.equal(dequantize(q8, torch.float32), torch.cat([a, a]))


def test_stack_of_tensors_stays_a_tensor():
    x, y = torch.randn(2, 4), torch.randn(3, 4)
    out = stack_rows([x, y])
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.cat([x, y]))
