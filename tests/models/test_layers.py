"""Shared layers against float64 arithmetic written out longhand."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.models import layers
from deltaserve.ops import fused
from deltaserve.models.layers import (STEP_TOKENS, Experts, GatedAttention, RMSNorm, RotaryEmbedding, apply_rotary,
                                      cached_attention, softmax_topk, swiglu)

GEN = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(shape, generator=GEN)


@pytest.mark.parametrize("case", ["fused", "strided", "autograd"])
def test_rmsnorm(case):
    """Inference on contiguous float32 rows takes the fused C++ kernel; the rest the torch expression."""
    norm = RMSNorm(37, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(37))
    x = randn(2, 3, 37) if case != "strided" else randn(2, 3, 50)[..., :37]
    x64 = x.double()
    expected = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    with torch.set_grad_enabled(case == "autograd"):
        out = norm(x)
    assert out.requires_grad == (case == "autograd")
    assert torch.allclose(out.double(), expected, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["fused", "fused_inplace", "autograd"])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_rmsnorm_with_output_gate(act, case):
    """norm(o) * act(z) per head, z sliced out of a wider projection row as the GDN / KDA layers pass it."""
    norm = RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(24))
    o, proj = randn(2, 5, 3, 24), randn(2, 5, 3 * 24 + 11)
    z = proj[..., 7:7 + 3 * 24].view(2, 5, 3, 24)
    o64, z64 = o.double(), z.double()
    gate = z64 * torch.sigmoid(z64) if act == "silu" else torch.sigmoid(z64)
    expected = o64 / torch.sqrt((o64 ** 2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double() * gate
    with torch.set_grad_enabled(case == "autograd"):
        out = norm(o.requires_grad_(case == "autograd"), gate=z, gate_act=act, inplace=case == "fused_inplace")
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert (out.data_ptr() == o.data_ptr()) == (case == "fused_inplace")


@pytest.mark.parametrize("case", ["fused", "fused_inplace", "autograd"])
@pytest.mark.parametrize("wide", [False, True], ids=["contiguous", "rows_of_a_wider_buffer"])
@pytest.mark.parametrize("rows", [1, 7], ids=lambda r: f"rows{r}")
def test_swiglu(rows, wide, case):
    gate_up = randn(rows, 2 * 40 + 3)[:, :80] if wide else randn(rows, 80)
    g64, u64 = gate_up.double().chunk(2, dim=-1)
    expected = g64 * torch.sigmoid(g64) * u64
    with torch.set_grad_enabled(case == "autograd"):
        out = swiglu(gate_up, inplace=case == "fused_inplace")
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    # in place only where the rows are the buffer itself (contiguous): the result is then its gate half
    assert (out.data_ptr() == gate_up.data_ptr()) == (case == "fused_inplace" and gate_up.is_contiguous())


def test_partial_rotary_rotates_channel_pairs():
    head_dim, rot, theta = 10, 6, 100.0
    x = randn(2, 3, 4, head_dim)
    positions = torch.tensor([[0, 1, 2], [7, 8, 40]])
    out = apply_rotary(x, *RotaryEmbedding(rot, theta)(positions))
    half = rot // 2
    for n in range(2):
        for t in range(3):
            for i in range(half):  # channels i and i + half form the complex number x_i + j x_{i+half}
                angle = positions[n, t].item() * theta ** (-2 * i / rot)
                z = torch.complex(x[n, t, :, i].double(), x[n, t, :, i + half].double()) * complex(
                    math.cos(angle), math.sin(angle))
                assert torch.allclose(out[n, t, :, i].double(), z.real, atol=1e-5)
                assert torch.allclose(out[n, t, :, i + half].double(), z.imag, atol=1e-5)
    assert torch.equal(out[..., rot:], x[..., rot:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["f32_cache", "f16_cache"])
@pytest.mark.parametrize("query_block", [None, 7], ids=["one_block", "blocks_of_7_mask_entries"])
@pytest.mark.parametrize("slots, start, T", [([2, 0], [5, 0], 4), ([2], [5], 1), ([1], [3], 3)],
                         ids=["two_sequences", "one_token_decode", "one_sequence_chunk"])
def test_cached_attention_against_naive_loop(slots, start, T, query_block, cache_dtype, monkeypatch):
    if query_block:  # a few queries per SDPA call (the mask budget counts query rows x keys)
        monkeypatch.setattr(layers, "_ATTN_MASK_ELEMENTS", query_block)
    n_slots, max_len, nh, nkv, dk, dv = 3, 12, 6, 2, 5, 3
    k_cache = randn(n_slots, max_len, nkv, dk).to(cache_dtype)
    v_cache = randn(n_slots, max_len, nkv, dv).to(cache_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots, start = torch.tensor(slots), torch.tensor(start)
    N = len(slots)
    q, k, v = randn(N, T, nh, dk), randn(N, T, nkv, dk), randn(N, T, nkv, dv)
    out = cached_attention(q, k, v, k_cache, v_cache, slots, start, scale=0.7)

    for n in range(N):
        s, p0 = slots[n].item(), start[n].item()
        new_k, new_v = k[n].to(cache_dtype), v[n].to(cache_dtype)  # what the cache keeps of them
        keys = torch.cat([before_k[s, :p0], new_k]).double()  # what the slot holds after the write
        values = torch.cat([before_v[s, :p0], new_v]).double()
        assert torch.equal(k_cache[s, p0:p0 + T], new_k) and torch.equal(v_cache[s, :p0], before_v[s, :p0])
        for t in range(T):
            for h in range(nh):
                kv = h // (nh // nkv)
                scores = keys[:p0 + t + 1, kv] @ q[n, t, h].double() * 0.7
                expected = scores.softmax(0) @ values[:p0 + t + 1, kv]
                assert torch.allclose(out[n, t, h].double(), expected, atol=1e-5)
    untouched = [r for r in range(n_slots) if r not in slots.tolist()]
    assert all(torch.equal(k_cache[r], before_k[r]) and torch.equal(v_cache[r], before_v[r]) for r in untouched)


def test_router_and_experts_against_per_token_loop():
    n, hidden, inter, M, top_k = 5, 7, 3, 6, 2
    experts = Experts(n, hidden, inter)
    with torch.no_grad():
        experts.gate_up.copy_(randn(n, 2 * inter, hidden))
        experts.down.copy_(randn(n, hidden, inter))
    x, logits = randn(M, hidden), randn(M, n)
    weights, ids = softmax_topk(logits, top_k, normalize=True)
    out = experts(x, ids, weights)
    for m in range(M):
        probs = logits[m].double().softmax(0)
        chosen = probs.argsort(descending=True)[:top_k]
        assert set(ids[m].tolist()) == set(chosen.tolist())
        expected = torch.zeros(hidden, dtype=torch.float64)
        for e in chosen.tolist():
            h = experts.gate_up[e].double() @ x[m].double()
            gate, up = h[:inter], h[inter:]
            y = experts.down[e].double() @ (gate * torch.sigmoid(gate) * up)
            expected += probs[e] / probs[chosen].sum() * y
        assert torch.allclose(out[m].double(), expected, atol=1e-5)
    unnormalised, _ = softmax_topk(logits, top_k, normalize=False)
    assert torch.allclose(unnormalised, logits.softmax(-1).topk(top_k).values)


@pytest.mark.parametrize("first", [0, 2], ids=["all-experts", "rank-holding-2-of-5"])
def test_one_token_takes_the_experts_as_grouping_does(first):
    """A decode step's token runs its experts one after another: the grouped path's sums for that token, in the
    same order, bit for bit, and float64's within rounding; a tensor-parallel rank adds only the experts it holds."""
    n, hidden, inter, top_k = 5, 7, 3, 3
    held = Experts(n - first, hidden, inter, first=first)
    with torch.no_grad():
        held.gate_up.copy_(randn(n - first, 2 * inter, hidden))
        held.down.copy_(randn(n - first, hidden, inter))
    x = randn(4, hidden)
    weights, ids = softmax_topk(randn(4, n), top_k, normalize=True)
    with torch.no_grad():
        for m in range(4):
            one = held(x[m:m + 1], ids[m:m + 1], weights[m:m + 1])
            assert torch.equal(one, held._grouped(x[m:m + 1], ids[m:m + 1], weights[m:m + 1]))
            expected = torch.zeros(hidden, dtype=torch.float64)
            for e, w in zip(ids[m].tolist(), weights[m].double()):
                if e >= first:
                    h = held.gate_up[e - first].double() @ x[m].double()
                    expected += w * (held.down[e - first].double() @ (h[:inter] * torch.sigmoid(h[:inter]) * h[inter:]))
            assert torch.allclose(one[0].double(), expected, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["f32_cache", "f16_cache"])
@pytest.mark.parametrize("hd", [20, 48], ids=["hd20", "hd48"])  # 48: whole 16-lane vectors and no tail
@pytest.mark.parametrize("T, kernel, calls_expected", [(1, "attention_step", 1), (5, "attention_step", 5),
                                              (STEP_TOKENS + 4, "norm_rope_rows", 1)], ids=["decode", "verify", "prefill"])
def test_attention_kernels_equal_torch_path(T, kernel, calls_expected, hd, cache_dtype, monkeypatch):
    """Two sequences, one new token each (the fused decode step), five (a verify pass: a decode step per token)
    or twelve (q/k norms and rope in place, then attention over the cache): inference against the layer's torch ops
    (taken whenever autograd is on), which test_cached_attention_against_naive_loop checks longhand. A float16
    cache holds the new keys rounded: both paths attend over what the cache holds."""
    nh, nkv, rot, E = 6, 2, 12, 16
    attn = GatedAttention(E, nh, nkv, hd, eps=1e-6)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(randn(*p.shape) * 0.5)
    slots, start = torch.tensor([3, 1]), torch.tensor([9, 4])
    x = randn(2, T, E)
    cos, sin = RotaryEmbedding(rot, 1000.0)(start[:, None] + torch.arange(T))
    caches = [randn(4, 24, nkv, hd).to(cache_dtype), randn(4, 24, nkv, hd).to(cache_dtype)]
    kernel_caches, torch_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    ext, calls = fused.extension(), []

    class Spy:  # the kernel module, counting calls by name
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ext, name)

    monkeypatch.setattr(fused, "extension", Spy)
    with torch.no_grad():
        got = attn(x, cos, sin, *kernel_caches, slots, start)
    assert calls.count(kernel) == calls_expected  # the kernel took this pass
    assert kernel == "attention_step" or calls.count("attention_cached") == 1  # a prefill attends through the tiles
    with torch.enable_grad():
        want = attn(x, cos, sin, *torch_caches, slots, start)
    # float16: a last-bit difference in a new key (the two paths norm and rotate in their own order) may round
    # it to the neighbouring float16, 2^-11 relative
    out_tol, cache_tol = (1e-5, 1e-6) if cache_dtype == torch.float32 else (2e-3, 2e-3)
    torch.testing.assert_close(got, want, rtol=out_tol, atol=out_tol)
    for a, b in zip(kernel_caches, torch_caches):  # the new keys and values written in the same places
        assert a.dtype == cache_dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=cache_tol, atol=cache_tol)
