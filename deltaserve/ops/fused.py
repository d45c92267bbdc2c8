"""Fused path: one pass over the tokens with the state kept hot, threads over (sequence, head, column block).

The kernels are C++ (csrc/: the delta rule, the conv, the decode layers, the GEMVs), compiled on first
use for this CPU with torch's extension builder and cached under ~/.cache/deltaserve. Where no compiler
is available, `available()` is False and "auto" dispatch uses the torch paths instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"  # module.cpp includes the kernel headers: one translation unit


@functools.cache
def extension():
    from torch.utils import cpp_extension

    source = b"".join(f.read_bytes() for f in sorted(_CSRC.iterdir()) if f.suffix in (".cpp", ".h"))
    # -march=native code is only valid on this CPU: key the build by source, CPU and torch.
    cpu = platform.processor() + _cpu_flags()
    tag = hashlib.sha256(source + cpu.encode() + torch.__version__.encode() + b"omp").hexdigest()[:12]
    build = Path(os.environ.get("DELTASERVE_CACHE", Path.home() / ".cache" / "deltaserve")) / f"cpu_kernels_{tag}"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"deltaserve_cpu_kernels_{tag}",
        sources=[str(_CSRC / "module.cpp")],
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def available() -> bool:
    """True when the CPU kernel compiles and loads here (the result is cached per process)."""
    try:
        extension()
        return True
    except Exception:  # no compiler, no ninja, unsupported platform: the torch paths still work
        return False


def fused(q, k, v, g, beta, *, scale, state, cu_seqlens, snapshots, use_qk_l2norm, state_indices=None):
    """q, k [..., H, K]; v [..., HV, V]; g [..., HV(, K)]; beta [..., HV], where the leading dims hold all
    sequences' tokens in order ([B, T] or [1, T] packed); cu_seqlens [N + 1] int64 on CPU; state
    [S, HV, K, V] float32, advanced in place: sequence n owns row state_indices[n] (row n when None).
    Returns (o like v, float32; state; snaps [N, snapshots, HV, K, V] | None)."""
    if q.device.type != "cpu":
        raise ValueError(f"backend='fused' runs on CPU tensors only, got device {q.device}")
    f32 = torch.float32
    o = torch.empty(v.shape, dtype=f32)
    q, k, v = (token_rows(x) for x in (q, k, v))
    # a decode step is ~40 us of kernel: skip every conversion that would be a no-op
    g, beta = (x if x.dtype == f32 and x.is_contiguous() else x.to(f32).contiguous() for x in (g, beta))
    N, (_, HV, K, V) = cu_seqlens.numel() - 1, state.shape
    idx = EMPTY_I64 if state_indices is None else state_indices.contiguous()
    snaps = torch.empty((N, snapshots, HV, K, V), dtype=f32) if snapshots else EMPTY_F32
    extension().gdr_forward(q, k, v, g, beta, state, cu_seqlens, idx, o, snaps, float(scale), bool(use_qk_l2norm))
    return o, state, (snaps if snapshots else None)


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] as the kernels read it, float32 [..., tokens, heads, D] with each token's heads x D
    contiguous and the tokens one stride apart: q, k and v sliced from a projection's output need no copy."""
    B, T, _, D = x.shape
    s = x.stride()
    if x.dtype == torch.float32 and s[3] == 1 and s[2] == D and (B == 1 or (T > 1 and s[0] == T * s[1])):
        return x  # the kernel reads the token stride as stride(-3): already so (a decode step stops here)
    x = x.reshape(-1, *x.shape[-2:])  # a view wherever one stride per token exists
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.to(torch.float32).contiguous()
    return x


# Empty placeholders the kernel reads as "absent" (never written).
EMPTY_I64 = torch.empty(0, dtype=torch.int64)
EMPTY_F32 = torch.empty(0, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def dense_cu_seqlens(B: int, T: int) -> torch.Tensor:
    """Offsets of B sequences of T tokens each, [0, T, 2T, ...] (shared: callers must not write it)."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int64)
