"""The decode step's attention (ops/csrc/layers.h attention_step, its passes in attn_step.h) at long spans against
the specification in float64: every register path (four keys x up to four heads, a lone key, a 16-column tail,
heads in groups of four and the rest, tiles of 128 keys and a short last tile) and the plain loops (a head size
that is not a multiple of 16), float32 and float16 caches."""

import pytest
import torch

from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels could not be built here")

EPS = 1e-6


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _reference(proj, q_w, k_cache, v_cache, slots, pos, nh, nkv, hd):
    """float64: q normalised (rope is the identity here: cos 1, sin 0), attention over the cache rows up to and
    including the new token as the cache holds them, the output gate."""
    out = torch.empty(proj.shape[0], nh * hd, dtype=torch.float64)
    group = nh // nkv
    for m in range(proj.shape[0]):
        row = proj[m].double()
        for h in range(nh):
            j = h // group
            q = _rms(row[h * hd:(h + 1) * hd], q_w.double())
            keys = k_cache[slots[m], :pos[m] + 1, j].double()
            vals = v_cache[slots[m], :pos[m] + 1, j].double()
            p = torch.softmax(keys @ q * hd ** -0.5, dim=0)
            gate = torch.sigmoid(row[(nh + h) * hd:(nh + h + 1) * hd])
            out[m, h * hd:(h + 1) * hd] = (p @ vals) * gate
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("hd, nh, nkv", [(256, 8, 2), (48, 6, 2), (80, 12, 2), (20, 4, 1)],
                         ids=["qwen35_0.8b", "group3_hd48", "group6_hd80", "plain_hd20"])
def test_attention_step_against_float64(hd, nh, nkv, cache_dtype):
    g = torch.Generator().manual_seed(hd + nh)
    slots, pos = torch.tensor([2, 0, 1]), torch.tensor([4098, 0, 130])  # spans 4099, 1 and 131 keys
    L = int(pos.max()) + 3
    k_cache = torch.randn(3, L, nkv, hd, generator=g).to(cache_dtype)
    v_cache = torch.randn(3, L, nkv, hd, generator=g).to(cache_dtype)
    proj = torch.randn(3, (2 * nh + 2 * nkv) * hd, generator=g)
    q_w, k_w = 1 + 0.3 * torch.randn(hd, generator=g), 1 + 0.3 * torch.randn(hd, generator=g)
    rot = 8
    cos, sin = torch.ones(3, rot), torch.zeros(3, rot)
    out = torch.empty(3, nh * hd)
    fused.extension().attention_step(proj, q_w, k_w, EPS, cos, sin, k_cache, v_cache, slots, pos, hd ** -0.5, out)
    for m in range(3):  # the new key (normalised) and value sit at the new position, as the cache's dtype rounds them
        for j in range(nkv):
            k_new = _rms(proj[m, (2 * nh + j) * hd:(2 * nh + j + 1) * hd].double(), k_w.double())
            v_new = proj[m, (2 * nh + nkv + j) * hd:(2 * nh + nkv + j + 1) * hd].double()
            tol = 1e-6 if cache_dtype == torch.float32 else 2 ** -10
            torch.testing.assert_close(k_cache[slots[m], pos[m], j].double(), k_new, rtol=tol, atol=tol)
            torch.testing.assert_close(v_cache[slots[m], pos[m], j].double(), v_new, rtol=tol, atol=tol)
    want = _reference(proj, q_w, k_cache, v_cache, slots, pos, nh, nkv, hd)
    # float32 sums over hd products and up to 4,099 keys: a few 1e-6 of the output's scale
    assert (out.double() - want).abs().max() <= 2e-5 * max(1.0, want.abs().max().item())
