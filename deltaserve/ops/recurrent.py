"""Recurrent path: the per-token step in torch ops, batched over sequences and heads (decode, any device)."""

from __future__ import annotations

import torch

from .reference import l2norm


def compute_dtype(x) -> torch.dtype:
    """float32, or float64 for float64 inputs (gradient checks against the reference)."""
    return torch.promote_types(x.dtype, torch.float32)


def prepare_qk(q, k, groups: int, scale: float, use_qk_l2norm: bool):
    """q, k in the compute dtype, expanded to the value heads (grouped order), q scaled. [N, T, HV, K] each."""
    dt = compute_dtype(q)
    q, k = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return q * scale, k


def recurrent(q, k, v, g, beta, *, scale, state, snapshots, use_qk_l2norm):
    """q, k [N, T, H, K]; v [N, T, HV, V]; g [N, T, HV(, K)]; beta [N, T, HV]; state [N, HV, K, V] fp32.
    Returns (o [N, T, HV, V] float32, final state, snaps [N, snapshots, HV, K, V] newest first | None)."""
    N, T, HV, V = v.shape
    q, k = prepare_qk(q, k, HV // q.shape[2], scale, use_qk_l2norm)
    dt = compute_dtype(v)
    v, beta = v.to(dt), beta.to(dt)
    decay = g.to(dt).exp()
    decay = decay[..., None, None] if decay.dim() == 3 else decay[..., None]  # [N, T, HV, 1|K, 1]
    o = v.new_empty(N, T, HV, V)
    snaps = state[:, None].repeat(1, snapshots, 1, 1, 1) if snapshots else None
    S = state
    for t in range(T):
        S = S * decay[:, t]
        kt = k[:, t, :, None, :]  # [N, HV, 1, K]
        u = beta[:, t, :, None] * (v[:, t] - (kt @ S)[:, :, 0])  # [N, HV, V]
        S = torch.baddbmm(S.view(N * HV, -1, V), kt.reshape(N * HV, -1, 1), u.view(N * HV, 1, V)).view_as(S)
        o[:, t] = (q[:, t, :, None, :] @ S)[:, :, 0]
        back = T - 1 - t
        if back < snapshots:
            snaps[:, back] = S
    return o, S, snaps
