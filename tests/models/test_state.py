"""HybridState: layout, per-slot reset, byte count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.models.state import HybridState
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
    recurrent, kv = [t for t in s.conv + s.ssm if t is not None], [t for t in s.k + s.v if t is not None]
    for t in recurrent:
        assert t[0].eq(0).all() and t[2].eq(0).all() and t[1].eq(1).all()
    for t in kv:  # up to the length; past it nothing is read
        assert t[[0, 2], :5].eq(0).all() and t[[0, 2], 5:].eq(1).all() and t[1].eq(1).all()
    s.reset()
    assert all(t.eq(0).all() for t in recurrent) and s.lengths.eq(0).all()
    assert all(t[:, :5].eq(0).all() for t in kv)
    with pytest.raises(DeltaserveError, match="out of range"):
        s.reset([3])


def _rss_mb() -> float | None:
    try:
        return next(int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None


def test_kv_cache_takes_memory_as_it_fills():
    """A CPU KV cache sized for many long slots (32 MB here) takes memory only where it is written."""
    before = _rss_mb()
    if before is None:
        pytest.skip("no /proc/self/status to read the resident memory from")
    s = HybridState.allocate([False], n_slots=8, max_len=4096, conv=(3, 4), ssm=(1, 1, 1), k=(2, 64), v=(2, 64))
    s.k[0][3, 10] = 1.5
    s.reset()
    assert _rss_mb() - before < 8
    assert s.k[0][3, 10].eq(1.5).all() and s.k[0].sum() == 1.5 * 2 * 64 and not s.v[0].any()
