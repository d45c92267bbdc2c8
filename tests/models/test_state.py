"""HybridState: layout, per-slot reset, byte count."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.state import HybridState
from deltaserve.errors import DeltaserveError


def make() -> HybridState:
    return HybridState.allocate([True, False, True], n_slots=3, max_len=7, conv=(3, 11), ssm=(4, 5, 6),
                                k=(2, 8), v=(2, 9), dtype=torch.bfloat16)


def test_layout():
    s = make()
    assert s.n_slots == 3 and s.max_len == 7
    assert s.conv[0].shape == (3, 3, 11) and s.conv[0].dtype == torch.bfloat16 and s.conv[1] is None
    assert s.ssm[2].shape == (3, 4, 5, 6) and s.ssm[2].dtype == torch.float32
    assert s.k[1].shape == (3, 7, 2, 8) and s.v[1].shape == (3, 7, 2, 9) and s.k[0] is None
    assert s.lengths.dtype == torch.long and s.lengths.tolist() == [0, 0, 0]
    per_slot = 2 * (3 * 11 * 2 + 4 * 5 * 6 * 4) + 7 * 2 * (8 + 9) * 2 + 8  # two GDN layers, one attention
    assert s.nbytes() == 3 * per_slot


def test_reset_only_touches_given_slots():
    s = make()
    for t in s.tensors():
        t.fill_(1)
    s.lengths.fill_(5)
    s.reset([0, 2])
    assert s.lengths.tolist() == [0, 5, 0]
    for t in s.tensors():
        assert t[0].eq(0).all() and t[2].eq(0).all() and t[1].eq(1).all()
    s.reset()
    assert all(t.eq(0).all() for t in s.tensors()) and s.lengths.eq(0).all()
    with pytest.raises(DeltaserveError, match="out of range"):
        s.reset([3])
