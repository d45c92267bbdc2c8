"""Chunked path (WY / UT form): batched matmuls inside chunks, a short sequential pass across them.

Inside a chunk of C tokens, with gc the cumulative log-decay from the chunk start:
    A = (I + strict_lower((beta k) k^T * exp(gc_i - gc_j)))^-1          (unit lower-triangular solve)
    w = A (beta k exp(gc)),   u = A (beta v)
Across chunks, with S the state entering the chunk:
    v_new = u - w S
    o     = scale * [(q exp(gc)) S + (q k^T * exp(gc_i - gc_j) * causal) v_new]
    S    <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new
Per-channel decays carry the exponent differences per key channel, [C, C, K], which is why they use a
smaller chunk. Everything is differentiable (training runs through this path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .recurrent import compute_dtype, prepare_qk, recurrent

CHUNK_HEADWISE = 64
CHUNK_PER_CHANNEL = 32


def chunk(q, k, v, g, beta, *, scale, state, snapshots, use_qk_l2norm, chunk_size=None):
    """Same contract as recurrent(): dense [N, T, ...] inputs. Snapshots come from running the last
    `snapshots` tokens through the recurrent step, so every snapshot is a true per-token state."""
    T = v.shape[1]
    if T == 0:
        return v.new_zeros(v.shape, dtype=compute_dtype(v)), state, None
    tail = min(snapshots, T)
    if tail:
        head = T - tail
        o_head, S, _ = chunk(q[:, :head], k[:, :head], v[:, :head], g[:, :head], beta[:, :head], scale=scale,
                             state=state, snapshots=0, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        o_tail, S, snaps = recurrent(q[:, head:], k[:, head:], v[:, head:], g[:, head:], beta[:, head:],
                                     scale=scale, state=S, snapshots=snapshots, use_qk_l2norm=use_qk_l2norm)
        return torch.cat([o_head, o_tail], dim=1), S, snaps

    N, T, HV, V = v.shape
    per_channel = g.dim() == 4
    C = chunk_size or (CHUNK_PER_CHANNEL if per_channel else CHUNK_HEADWISE)
    q, k = prepare_qk(q, k, HV // q.shape[2], scale, use_qk_l2norm)
    dt = compute_dtype(v)
    pad = (-T) % C
    # Padded steps are exact no-ops: k = v = 0, beta = 0, g = 0 leave the state untouched.
    q, k, v = (F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [N, HV, Tp, D]
    beta = F.pad(beta.to(dt), (0, 0, 0, pad)).transpose(1, 2)  # [N, HV, Tp]
    g = g.to(dt)
    g = (F.pad(g, (0, 0, 0, 0, 0, pad)) if per_channel else F.pad(g, (0, 0, 0, pad))).transpose(1, 2)
    nc = (T + pad) // C
    q, k, v = (x.reshape(N, HV, nc, C, -1) for x in (q, k, v))  # [N, HV, nc, C, D]
    beta = beta.reshape(N, HV, nc, C, 1)
    gc = g.reshape(N, HV, nc, C, -1).cumsum(3)  # [N, HV, nc, C, 1|K]

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    if per_channel:
        # exp(gc_i - gc_j) per channel, [.., C, C, K]; masked before exp so the upper triangle cannot overflow
        diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()
        kk = torch.einsum("...ik,...jk,...ijk->...ij", k * beta, k, diff)
        qk = torch.einsum("...ik,...jk,...ijk->...ij", q, k, diff)
    else:
        diff = (gc - gc.transpose(-1, -2)).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]
        kk = (k * beta) @ k.transpose(-1, -2) * diff
        qk = q @ k.transpose(-1, -2) * diff
    eye = torch.eye(C, dtype=kk.dtype, device=kk.device)
    system = kk.masked_fill(~strict, 0) + eye
    egc = gc.exp()
    rhs = torch.cat([beta * v, beta * k * egc], dim=-1)
    wu = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = wu[..., :V], wu[..., V:]
    q_dec = q * egc  # [N, HV, nc, C, K]
    k_dec = k * (gc[..., -1:, :] - gc).exp()
    last = gc[..., -1, :].exp()  # [N, HV, nc, 1|K]

    S = state
    outs = []
    for c in range(nc):
        ws = torch.cat([w[:, :, c], q_dec[:, :, c]], dim=-2) @ S  # [N, HV, 2C, V]: one matmul reads S twice
        v_new = u[:, :, c] - ws[..., :C, :]
        outs.append(ws[..., C:, :] + qk[:, :, c] @ v_new)
        S = S * last[:, :, c, :, None] + k_dec[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(N, HV, nc * C, V)[:, :, :T].transpose(1, 2)
    return o, S, None
