"""Causal attention over a per-slot KV cache: the float64 specification and the C++ kernel (csrc/attention.h).

Layout, as the models keep it: q [N, T, nh, dk]; caches [n_slots, max_len, nkv, d] (the values may be a
slice of the keys' rows, as Kimi's latent cache is); sequence n owns cache row slots[n] and its query t
sits at position start[n] + t, seeing the keys at positions 0 .. start[n] + t. Query head h reads kv head
h // (nh / nkv). The new tokens' keys and values are in the cache before attention reads it.

The kernel holds no score matrix over the span (a tile of 64 keys at a time, online softmax), so its
memory does not grow with the context; the torch path it replaces (models/layers.py) is the fallback where
it does not apply (autograd, other devices or dtypes, no compiler).
"""

from __future__ import annotations

import torch

from . import fused

CACHE_DTYPES = (torch.float32, torch.float16)  # caches the kernel reads where they lie


def kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether attention_cached can compute this call: inference on CPU, float32 queries, float32 or float16
    caches of one dtype with contiguous last dims, and the kernels built."""
    return (not torch.is_grad_enabled() and q.is_cpu and k_cache.is_cpu and v_cache.is_cpu
            and q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and fused.available())


def attention_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor, scale: float) -> torch.Tensor:
    """The C++ kernel (see kernel_applies): [N, T, nh, dv] float32."""
    N, T, nh, _ = q.shape
    out = torch.empty(N, T, nh, v_cache.shape[-1], dtype=torch.float32)
    fused.extension().attention_cached(q, k_cache, v_cache, slots.to(torch.int64).contiguous(),
                                       start.to(torch.int64).contiguous(), float(scale), out)
    return out


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        start: torch.Tensor, scale: float) -> torch.Tensor:
    """The specification in float64, one sequence and head at a time with the whole score row: [N, T, nh, dv]."""
    N, T, nh, _ = q.shape
    group = nh // k_cache.shape[2]
    out = torch.empty(N, T, nh, v_cache.shape[-1], dtype=torch.float64)
    for n in range(N):
        s, p = int(slots[n]), int(start[n])
        keys, values = k_cache[s, :p + T].double(), v_cache[s, :p + T].double()  # [S, nkv, d]
        for h in range(nh):
            scores = q[n, :, h].double() @ keys[:, h // group].T * scale  # [T, S]
            visible = torch.arange(p + T) <= (p + torch.arange(T))[:, None]
            out[n, :, h] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values[:, h // group]
    return out
