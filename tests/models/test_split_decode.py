"""A decode step over a long cache with fewer (sequence, kv head) pairs than threads leaves the one-call step
kernel for the tiled attention kernel, whose key splits keep every thread busy; the outputs and cache writes
are those of the layer's torch ops (taken whenever autograd is on)."""

import pytest
import torch

from deltaserve.models import layers
from deltaserve.models.layers import GatedAttention, RotaryEmbedding
from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not compile here")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["f32_cache", "f16_cache"])
def test_long_decode_with_idle_threads_splits_the_keys(cache_dtype, monkeypatch):
    monkeypatch.setattr(layers, "_SPLIT_DECODE_SPAN", 300)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # one sequence x 2 kv heads < 3 threads
    try:
        g = torch.Generator().manual_seed(3)
        nh, nkv, hd, E = 6, 2, 64, 40
        attn = GatedAttention(E, nh, nkv, hd, eps=1e-6)
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        start, slots = torch.tensor([777]), torch.tensor([1])  # 778 keys: split in three
        x = torch.randn(1, 1, E, generator=g)
        cos, sin = RotaryEmbedding(16, 1000.0)(start[:, None])
        caches = [torch.randn(2, 800, nkv, hd, generator=g).to(cache_dtype) for _ in range(2)]
        kernel_caches, torch_caches = [c.clone() for c in caches], [c.clone() for c in caches]
        ext, calls = fused.extension(), []

        class Spy:  # the kernel module, counting calls by name
            def __getattr__(self, name):
                calls.append(name)
                return getattr(ext, name)

        monkeypatch.setattr(fused, "extension", Spy)
        with torch.no_grad():
            got = attn(x, cos, sin, *kernel_caches, slots, start)
        assert "attention_step" not in calls and calls.count("attention_cached") == 1
        with torch.enable_grad():
            want = attn(x, cos, sin, *torch_caches, slots, start)
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-3  # a new key may round to the neighbouring float16
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip(kernel_caches, torch_caches):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
