"""gated_delta_rule: argument checks, reset / in-place / packed handling, and the choice of path.

State layout, everywhere in deltaserve: float32 [N, HV, K, V], one K x V matrix per sequence and value head.
"""

from __future__ import annotations

import torch

from . import fused as fused_mod
from .checks import check_cu_seqlens, check_reset, check_state_indices, fail
from .chunk import chunk
from .recurrent import recurrent
from .reference import gated_delta_rule_reference

BACKENDS = ("auto", "reference", "recurrent", "chunk", "fused")

# Measured with `python -m deltaserve.bench.ops` on a 2-core AVX-512 Xeon (K = V = 128): the fused CPU kernel
# is fastest at every T from 1 to 4096, so CPU always takes it when it compiled. On other devices (no fused
# kernel) the chunked form wins from about 64 tokens up (ik_llama.cpp #1320 reports the same crossover).
_RECURRENT_MAX_T = 32


def choose_backend(q, T: int, needs_grad: bool) -> str:
    if needs_grad:
        return "chunk"  # the only differentiable fast path
    if q.is_cpu and fused_mod.available():
        return "fused"
    return "recurrent" if T <= _RECURRENT_MAX_T else "chunk"


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, reset=None, cu_seqlens=None,
                     state_indices=None, inplace=False, snapshots=0, use_qk_l2norm=False, backend="auto"):
    """The gated delta rule (see ops/reference.py for the math), in the fla layout.

    q, k [B, T, H, K]; v [B, T, HV, V]; g log-decay [B, T, HV] (head-wise) or [B, T, HV, K] (per channel);
    beta [B, T, HV]; initial_state [N, HV, K, V] float32 (N = B, or the number of packed sequences).
    reset [N] bool: those sequences start from zero whatever initial_state holds.
    cu_seqlens [N + 1]: packed variable-length sequences in one batch row (B = 1).
    state_indices [N]: initial_state is a cache of S >= N slots and sequence n uses slot state_indices[n].
    inplace: write the final state into initial_state (the cache) instead of a new tensor.
    snapshots=K: also return the states after each of the last K tokens, [N, K, HV, K, V], newest first
    (for a sequence shorter than K the older entries hold its initial state).
    Returns (o [B, T, HV, V] in v's dtype, final state[, snapshots]).
    """
    if (inplace and reset is None and cu_seqlens is None and not snapshots and backend in ("auto", "fused")
            and fused_mod.available()):
        o = fused_mod.inplace_step(q, k, v, g, beta, initial_state, state_indices, scale, use_qk_l2norm)
        if o is not None:  # the common call (a model's prefill or decode), checked and run in C++
            return o, initial_state
    B, T, N, HV, K, V = _check(q, k, v, g, beta, initial_state, cu_seqlens, state_indices, inplace, snapshots, backend)
    scale = K ** -0.5 if scale is None else float(scale)
    if reset is not None:
        reset = check_reset(reset, N, q.device)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad
                                              or beta.requires_grad or getattr(initial_state, "requires_grad", False))
    if backend == "auto":
        backend = choose_backend(q, T, needs_grad)

    cache, idx = initial_state, state_indices
    # The fused kernel reads and writes cache slots where they lie; the torch paths get the rows gathered.
    direct = backend == "fused" and inplace and cache is not None and cache.is_contiguous()
    if cache is None:
        state = q.new_zeros(N, HV, K, V, dtype=torch.float32)
    elif direct:
        state = cache
        if reset is not None:  # masked_fill, not multiply: NaN must not leak
            rows = torch.arange(N, device=q.device) if idx is None else idx
            state.index_fill_(0, rows[reset], 0)
    else:
        state = cache if idx is None else cache[idx]
        if reset is not None:
            state = state.masked_fill(reset[:, None, None, None], 0)
        if backend == "fused" and (state is cache or not state.is_contiguous()):
            state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes its state argument
        idx = None  # rows are gathered: state row n is sequence n

    if backend == "reference":
        bounds = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
                  [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
        o, final, snaps = gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=state,
                                                     seq_bounds=bounds, snapshots=snapshots,
                                                     use_qk_l2norm=use_qk_l2norm)
        final, snaps = final.float(), (snaps.float() if snaps is not None else None)
    elif backend == "fused":
        cu = fused_mod.dense_cu_seqlens(B, T) if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64)
        o, final, snaps = fused_mod.fused(q, k, v, g, beta, scale=scale, state=state, cu_seqlens=cu,
                                          snapshots=snapshots, use_qk_l2norm=use_qk_l2norm, state_indices=idx)
    else:
        fn = chunk if backend == "chunk" else recurrent
        kw = dict(scale=scale, state=state, snapshots=snapshots, use_qk_l2norm=use_qk_l2norm)
        if cu_seqlens is None:
            o, final, snaps = fn(q, k, v, g, beta, **kw)
        else:
            padded, index = _left_pad(cu_seqlens, q, k, v, g, beta)
            o, final, snaps = fn(*padded, **kw)
            o = o.reshape(-1, HV, V)[index][None]

    if inplace:
        if final is not cache:
            if state_indices is None:
                cache.copy_(final)
            else:
                cache.index_copy_(0, state_indices, final)
        final = cache
    if o.dtype != v.dtype:
        o = o.to(v.dtype)
    return (o, final, snaps) if snapshots else (o, final)


def _left_pad(cu_seqlens, *xs):
    """Packed [1, T, ...] tensors -> [N, Lmax, ...], each sequence right-aligned behind zeros. Zero steps
    (k = v = 0, beta = 0, g = 0) are exact no-ops, and right alignment puts every sequence's last tokens
    at the same steps, so snapshots line up. Returns the padded tensors and the index back to packed order."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    N, L = lens.numel(), int(lens.max())
    seq_of = torch.repeat_interleave(torch.arange(N), lens.cpu())
    pos = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[:-1].cpu()[seq_of] + (L - lens.cpu()[seq_of])
    index = (seq_of * L + pos).to(xs[0].device)
    padded = []
    for x in xs:
        buf = x.new_zeros(N * L, *x.shape[2:])
        buf[index] = x[0]
        padded.append(buf.view(N, L, *x.shape[2:]))
    return padded, index


def _check(q, k, v, g, beta, initial_state, cu_seqlens, state_indices, inplace, snapshots, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = q.device if isinstance(q, torch.Tensor) else None
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                             + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else ""))
        if x.device != device:
            fail(name, f"is on {x.device} but q is on {device}", q=q, **{name: x})
    qs, vs = q.shape, v.shape
    if len(qs) != 4 or k.shape != qs:
        fail("q, k", "must both be [B, T, H, K]", q=q, k=k)
    B, T, H, K = qs
    if len(vs) != 4 or vs[0] != B or vs[1] != T:
        fail("v", f"must be [B, T, HV, V] with B, T = {B}, {T}", q=q, v=v)
    HV, V = vs[2], vs[3]
    if HV % H:
        fail("v", f"has HV = {HV} value heads, not a multiple of H = {H} key heads", q=q, v=v)
    if beta.shape != (B, T, HV):
        fail("beta", f"must be [B, T, HV] = [{B}, {T}, {HV}]", beta=beta)
    gs = g.shape
    if gs != (B, T, HV) and gs != (B, T, HV, K):
        fail("g", f"must be [B, T, HV] or [B, T, HV, K] = [{B}, {T}, {HV}(, {K})]", g=g)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if state_indices is not None:
        check_state_indices(state_indices, N, initial_state)
    if initial_state is not None:
        rows = initial_state.shape[0] if state_indices is not None else N
        if initial_state.shape != (rows, HV, K, V):
            fail("initial_state", f"must be [N, HV, K, V] = [{N}, {HV}, {K}, {V}]"
                 + (" (or [S, ...] with state_indices)" if state_indices is None else ""),
                 initial_state=initial_state)
        if initial_state.dtype != torch.float32:
            fail("initial_state", "must be float32", initial_state=initial_state)
        if initial_state.device != device:
            fail("initial_state", f"is on {initial_state.device} but q is on {device}",
                 initial_state=initial_state)
    elif inplace:
        raise ValueError("inplace=True needs an initial_state to write into")
    if not isinstance(snapshots, int) or snapshots < 0:
        raise ValueError(f"snapshots must be a non-negative int, got {snapshots!r}")
    return B, T, N, HV, K, V
