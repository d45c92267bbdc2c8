"""Argument checks shared by the ops: every error names the argument and the shapes it saw."""

from __future__ import annotations

import torch


def fail(arg: str, problem: str, **tensors):
    seen = ", ".join(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for name, t in tensors.items() if isinstance(t, torch.Tensor))
    raise ValueError(f"{arg} {problem}" + (f" (got {seen})" if seen else ""))


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Validates packed-sequence offsets; returns the number of sequences N."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of token offsets")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail("cu_seqlens", "must be int32 or int64", cu_seqlens=cu_seqlens)
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed inputs with batch size 1, got batch size {B}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {cu}")
    return len(cu) - 1


def check_reset(reset, N: int, device) -> torch.Tensor | None:
    if reset is None:
        return None
    reset = torch.as_tensor(reset, device=device)
    if reset.shape != (N,) or reset.dtype != torch.bool:
        fail("reset", f"must be a bool tensor [N] = [{N}]", reset=reset)
    return reset


def check_state_indices(state_indices, N: int, cache) -> None:
    """Sequence n uses cache row state_indices[n]: distinct rows, in range."""
    if cache is None:
        raise ValueError("state_indices needs a cache passed as initial_state / conv_state")
    if not isinstance(state_indices, torch.Tensor) or state_indices.dtype != torch.int64 or state_indices.shape != (N,):
        raise ValueError(f"state_indices must be an int64 tensor [N] = [{N}], got "
                         f"{getattr(state_indices, 'dtype', type(state_indices).__name__)} "
                         f"{tuple(getattr(state_indices, 'shape', ()))}")
    if state_indices.device != cache.device:
        fail("state_indices", f"must be on {cache.device}", state_indices=state_indices)
    rows = state_indices.tolist()  # a handful of ints: Python checks them faster than tensor ops
    if any(not 0 <= r < cache.shape[0] for r in rows):
        raise ValueError(f"state_indices {rows} must lie in [0, {cache.shape[0]})")
    if len(set(rows)) != N:
        raise ValueError(f"state_indices {rows} must be distinct")
