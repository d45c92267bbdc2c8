"""The gated delta rule, token by token in float64: the specification every other path must match.

Per sequence and value head, with state S [K, V] and g the log-decay (a scalar per head, or one value
per key channel):
    S' = exp(g_t) * S                      (per channel: row i of S times exp(g_t[i]))
    u_t = beta_t * (v_t - S'^T k_t)
    S_t = S' + k_t u_t^T
    o_t = scale * S_t^T q_t
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as transformers and fla define it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_reference(q, k, v, g, beta, *, scale, initial_state, seq_bounds, snapshots=0,
                               use_qk_l2norm=False):
    """Float64 loop over tokens. Returns (o [B,T,HV,V], final state [N,HV,K,V], snaps | None), all float64.

    seq_bounds: list of (batch row, first token, end token) per sequence; initial_state [N,HV,K,V] (reset applied).
    snaps: [N, snapshots, HV, K, V], newest first; steps before a sequence's first token hold its initial state.
    """
    f64 = torch.float64
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    groups = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(groups, dim=2) * scale  # [B, T, HV, K]
    k = k.repeat_interleave(groups, dim=2)
    o = torch.zeros(v.shape, dtype=f64, device=v.device)
    initial_state = initial_state.to(f64)
    finals, snaps = [], None
    if snapshots:
        snaps = initial_state[:, None].repeat(1, snapshots, 1, 1, 1)
    for n, (b, start, end) in enumerate(seq_bounds):
        S = initial_state[n]  # [HV, K, V]
        for t in range(start, end):
            decay = g[b, t].exp()  # [HV] or [HV, K]
            S = S * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t])  # o is written, never read: autograd allows it
            back = end - 1 - t  # 0 for the newest token
            if snaps is not None and back < snapshots:
                snaps[n, back] = S
        finals.append(S)
    return o, torch.stack(finals), snaps
