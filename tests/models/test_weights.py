"""The weight-table transforms against hand-computed layouts, each with its inverse; reading picks the
layout a file holds and names a missing tensor."""

import pytest
import torch

from deltaserve.convert import TensorDict
from deltaserve.errors import ModelLoadError
from deltaserve.models.weights import (NEG_EXP, PLUS_ONE, Either, cat, either, leaf, per_head, read, reshape, stack,
                                       tiled_heads, write)


def labelled(rows: list[int], cols: int = 3) -> torch.Tensor:
    """Row i holds the value rows[i] in every column."""
    return torch.tensor(rows, dtype=torch.float32)[:, None].expand(len(rows), cols).contiguous()


def test_tiled_value_heads_become_grouped():
    H, r, head = 3, 2, 2  # tiled row block j = rr * H + kh is value head (kh, rr), grouped index kh * r + rr
    tiled = labelled([kh * r + rr for rr in range(r) for kh in range(H) for _ in range(head)])
    fn = tiled_heads(0, H, r, head)
    grouped = fn.forward(tiled)
    assert grouped[:, 0].tolist() == [j for j in range(H * r) for _ in range(head)]
    assert torch.equal(fn.inverse(grouped), tiled)
    cols = tiled_heads(1, H, r, head).forward(tiled.T.contiguous())  # the same reorder of columns
    assert torch.equal(cols, grouped.T)


def test_tiled_value_heads_after_an_offset():
    fn = tiled_heads(0, 2, 2, 1, start=3)  # three rows pass through, then 4 heads of one row
    x = labelled([7, 8, 9, 0, 2, 1, 3])  # tiled: (kh0 rr0), (kh1 rr0), (kh0 rr1), (kh1 rr1) -> 0, 2, 1, 3
    assert fn.forward(x)[:, 0].tolist() == [7, 8, 9, 0, 1, 2, 3]
    assert torch.equal(fn.inverse(fn.forward(x)), x)


def test_per_head_parts_are_gathered():
    # two heads, each [a (1 row) | b (2 rows)], then one row that is not per head
    x = labelled([10, 11, 12, 20, 21, 22, 99])
    fn = per_head(2, [1, 2])
    assert fn.forward(x)[:, 0].tolist() == [10, 20, 11, 12, 21, 22, 99]
    assert torch.equal(fn.inverse(fn.forward(x)), x)


def test_elementwise_transforms_and_composition():
    x = torch.tensor([[0.25, -0.5]])
    assert torch.equal(PLUS_ONE.forward(x), torch.tensor([[1.25, 0.5]]))
    fn = reshape((1, 2), (2,)) >> NEG_EXP
    assert torch.allclose(fn.forward(x), -torch.exp(torch.tensor([0.25, -0.5])))
    assert torch.allclose(fn.inverse(fn.forward(x)), x)


def test_layouts_read_and_write_each_other():
    layout = cat(leaf("a", 2, 3), leaf("b", 1, 3, fn=PLUS_ONE))
    experts = stack([leaf(f"e.{j}", 2, 3) for j in range(2)])
    x = torch.arange(9.0).view(3, 3)
    written = dict(write(layout, x))
    assert torch.equal(written["a"], x[:2]) and torch.equal(written["b"], x[2:] - 1)
    assert torch.equal(read(layout, TensorDict(written)), x)
    y = torch.arange(12.0).view(2, 2, 3)
    assert torch.equal(read(experts, TensorDict(dict(write(experts, y)))), y)


def test_either_reads_the_layout_present_and_names_the_first_when_none_is():
    layout = either(leaf("new", 2, 2), cat(leaf("old.0", 1, 2), leaf("old.1", 1, 2)))
    assert isinstance(layout, Either)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    old = dict(write(layout, x, option=-1))
    assert set(old) == {"old.0", "old.1"} and torch.equal(read(layout, TensorDict(old)), x)
    with pytest.raises(ModelLoadError) as err:
        read(layout, TensorDict({"unrelated": x}))
    assert err.value.tensor == "new"
