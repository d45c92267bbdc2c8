"""argmax_rows (ops/csrc/layers.h), greedy decoding's choice in the one-call speculative step and the MTP drafts:
the index torch.argmax gives (the first of equal maxima, the first NaN), on hand-made rows and random ones."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels are not built on this machine")
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("row, expected", [
    ([1.0], 0),
    ([3.0, 1.0, 3.0], 0),                       # ties: the first
    ([-INF, -INF, -5.0], 2),
    ([-INF, -INF], 0),
    ([0.0, -0.0], 0),                           # equal values
    ([1.0, INF, 2.0, INF], 1),
    ([1.0, NAN, INF, NAN], 1),                  # a NaN wins over everything, the first of them
    ([NAN], 0),
    ([-1e-45, -2e-45], 0),                      # denormals compare as numbers
])
def test_hand_made_rows(row, expected):
    x = torch.tensor([row], dtype=torch.float32)
    assert fused.extension().argmax_rows(x).tolist() == [expected] == x.argmax(-1).tolist()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 4096, 248_320])
def test_random_rows_with_repeated_maxima_match_torch(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-20, 20, (7, n), generator=gen).float()  # small integers: many rows hold their max twice
    x[3, n // 2] = NAN
    x[5, -1] = INF
    ours = fused.extension().argmax_rows(x)
    assert ours.dtype == torch.int64 and torch.equal(ours, x.argmax(-1))


def test_shapes_it_refuses():
    ext = fused.extension()
    for bad in (torch.zeros(3), torch.zeros(2, 0), torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4, 2).t()):
        with pytest.raises(RuntimeError, match="argmax_rows"):
            ext.argmax_rows(bad)
