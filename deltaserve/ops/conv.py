"""Short causal depthwise conv1d with its state, run before the delta rule in every GDN / KDA layer.

Layout: x [B, T, C] (channel-last, as projections produce it), weight [C, W], conv state [N, W-1, C]
holding the last W-1 inputs of each sequence, oldest first (llama.cpp and vLLM keep W-1 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused
from .checks import check_cu_seqlens, check_reset, check_state_indices, fail


def causal_conv1d(x, weight, bias=None, *, conv_state=None, reset=None, cu_seqlens=None, state_indices=None,
                  inplace=False, activation="silu", backend="auto", out=None):
    """y[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - (W-1) + w, c]), inputs before the sequence taken
    from conv_state. state_indices [N]: conv_state is a cache of S slots, sequence n uses slot state_indices[n].
    backend: "torch", "fused" (the C++ CPU kernel, float32) or "auto" (fused on CPU where it compiled).
    out: a tensor like x to write y into, x itself allowed (inference: saves a buffer the size of x).
    Returns (y [B, T, C] in x's dtype, new conv state [N, W-1, C], or the whole cache when inplace)."""
    if x.dim() != 3:
        fail("x", "must be [B, T, C]", x=x)
    B, T, Ch = x.shape
    if weight.dim() != 2 or weight.shape[0] != Ch:
        fail("weight", f"must be [C, W] with C = {Ch}", x=x, weight=weight)
    if bias is not None and bias.shape != (Ch,):
        fail("bias", f"must be [{Ch}]", bias=bias)
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if backend not in ("auto", "torch", "fused"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'fused', got {backend!r}")
    W = weight.shape[1]
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if state_indices is not None:
        check_state_indices(state_indices, N, conv_state)
    rows = conv_state.shape[0] if state_indices is not None else N
    if conv_state is not None and conv_state.shape != (rows, W - 1, Ch):
        fail("conv_state", f"must be [N, W-1, C] = [{N}, {W - 1}, {Ch}]", conv_state=conv_state)
    if conv_state is not None and conv_state.device != x.device:
        fail("conv_state", f"must be on {x.device}", conv_state=conv_state)
    if inplace and conv_state is None:
        raise ValueError("inplace=True needs a conv_state to write into")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        fail("out", "must have x's shape, dtype and device", x=x, out=out)
    reset = check_reset(reset, N, x.device)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, bias, conv_state))
    if backend == "auto":  # the kernel has no backward: training takes the torch path
        backend = "fused" if x.device.type == "cpu" and fused.available() and not needs_grad else "torch"
    if backend == "fused" and (x.device.type != "cpu" or needs_grad):
        raise ValueError("backend='fused' runs on CPU tensors without gradients, got "
                         f"device {x.device}{' and inputs that require grad' if needs_grad else ''}")

    dtype = torch.float32 if backend == "fused" else torch.promote_types(x.dtype, weight.dtype)
    direct = backend == "fused" and inplace and conv_state.dtype == dtype and conv_state.is_contiguous()
    if direct:  # the kernel updates the cache rows where they lie
        state = conv_state
        if reset is not None:
            rows = torch.arange(N, device=x.device) if state_indices is None else state_indices
            state.index_fill_(0, rows[reset], 0)
    elif conv_state is None:
        state = x.new_zeros(N, W - 1, Ch, dtype=dtype)
    else:
        state = (conv_state if state_indices is None else conv_state[state_indices]).to(dtype)
        if reset is not None:
            state = state.masked_fill(reset[:, None, None], 0)  # masked_fill, not multiply: NaN must not leak
        if backend == "fused":
            state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes its state argument

    if backend == "fused":
        cu = fused.dense_cu_seqlens(B, T) if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64)
        # the kernel writes rows any stride apart, so out is used where it lies if it is float32 rows
        y = out.reshape(B * T, Ch) if _rows_view(out, dtype) else torch.empty(B * T, Ch, dtype=dtype)
        idx = state_indices if direct and state_indices is not None else fused.EMPTY_I64
        rows = x.reshape(B * T, Ch)  # tokens may lie any stride apart (a slice of a projection's output)
        if rows.dtype != dtype or rows.stride(1) != 1:
            rows = rows.to(dtype).contiguous()
        fused.extension().conv_forward(rows, weight.to(dtype).contiguous(),
                                       fused.EMPTY_F32 if bias is None else bias.to(dtype).contiguous(), state,
                                       cu, idx, y, activation == "silu")
        y, new_state = y.view(B, T, Ch), state
    else:
        y, new_state = _conv_torch(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), state,
                                   cu_seqlens, activation)
    if inplace and not direct:
        if state_indices is None:
            conv_state.copy_(new_state)
        else:
            conv_state.index_copy_(0, state_indices, new_state.to(conv_state.dtype))
    if inplace:
        new_state = conv_state
    if out is None:
        return y.to(x.dtype), new_state
    if y.data_ptr() != out.data_ptr():
        out.copy_(y)
    return out, new_state


def _rows_view(t, dtype) -> bool:
    """Whether t [B, T, C] is float rows of `dtype` that reshape to [B * T, C] as a view (one stride per row)."""
    return (t is not None and t.dtype == dtype and t.stride(-1) == 1
            and (t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)))


def _conv_torch(x, weight, bias, state, cu_seqlens, activation):
    """The conv in torch ops: x [B, T, C], state [N, W-1, C] -> (y [B, T, C], new state [N, W-1, C])."""
    (_, T, Ch), W, N = x.shape, weight.shape[1], state.shape[0]
    if cu_seqlens is None:
        xp = torch.cat([state, x], dim=1)  # [B, W-1+T, C]
        y = sum(xp[:, w:w + T] * weight[:, w] for w in range(W))
        new_state = xp[:, T:]
    else:
        # Packed: lay each sequence after its own state, [state_n | tokens_n], then read windows by index.
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        seq_of = torch.repeat_interleave(torch.arange(N, device=x.device), lens, output_size=T)
        tok_pos = torch.arange(T, device=x.device) + (seq_of + 1) * (W - 1)  # token t's place in xp
        starts = cu_seqlens[:-1] + torch.arange(N, device=x.device) * (W - 1)  # where state n begins
        xp = x.new_empty(T + N * (W - 1), Ch)
        xp[tok_pos] = x[0]
        xp[(starts[:, None] + torch.arange(W - 1, device=x.device)).flatten()] = state.reshape(-1, Ch)
        y = sum(xp[tok_pos - (W - 1) + w] * weight[:, w] for w in range(W))[None]
        new_state = xp[(starts + lens)[:, None] + torch.arange(W - 1, device=x.device)]  # last W-1 of each block
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = F.silu(y)
    return y, new_state
