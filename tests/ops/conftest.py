import pytest
import torch

from deltaserve.ops import fused

FAST_BACKENDS = ["recurrent", "chunk", "fused"]


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    """torch.empty & co. return NaN-filled memory in tests, so a read of an unwritten element shows."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: fill(real_new_empty(self, *a, **kw)))


@pytest.fixture(params=FAST_BACKENDS)
def backend(request):
    if request.param == "fused" and not fused.available():
        pytest.skip("fused CPU kernel did not compile here (no C++ compiler or ninja)")
    return request.param


@pytest.fixture(params=["torch", "fused"])
def conv_backend(request):
    if request.param == "fused" and not fused.available():
        pytest.skip("fused CPU kernel did not compile here (no C++ compiler or ninja)")
    return request.param
