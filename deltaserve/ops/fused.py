"""Fused path: one pass over the tokens with the state kept hot, threads over (sequence, head, column block).

The kernel is C++ (csrc/gdr_cpu.cpp), compiled on first use for this CPU with torch's extension
builder and cached under ~/.cache/deltaserve. Where no compiler is available, `available()` is
False and "auto" dispatch uses the torch paths instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "gdr_cpu.cpp"


@functools.cache
def extension():
    from torch.utils import cpp_extension

    source = _SOURCE.read_bytes()
    # -march=native code is only valid on this CPU: key the build by source, CPU and torch.
    cpu = platform.processor() + _cpu_flags()
    tag = hashlib.sha256(source + cpu.encode() + torch.__version__.encode() + b"omp").hexdigest()[:12]
    build = Path(os.environ.get("DELTASERVE_CACHE", Path.home() / ".cache" / "deltaserve")) / f"gdr_cpu_{tag}"
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"deltaserve_gdr_cpu_{tag}",
        sources=[str(_SOURCE)],
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
    """q, k [1, T, H, K]; v [1, T, HV, V]; g [1, T, HV(, K)]; beta [1, T, HV]; cu_seqlens [N + 1];
    state [S, HV, K, V] float32, advanced in place: sequence n owns row state_indices[n] (row n when None).
    Returns (o [1, T, HV, V] float32, state, snaps [N, snapshots, HV, K, V] | None)."""
    if q.device.type != "cpu":
        raise ValueError(f"backend='fused' runs on CPU tensors only, got device {q.device}")
    f32 = torch.float32
    q, k, v, g, beta = (x[0].to(f32).contiguous() for x in (q, k, v, g, beta))
    N, (_, HV, K, V) = cu_seqlens.numel() - 1, state.shape
    idx = torch.empty(0, dtype=torch.int64) if state_indices is None else state_indices.to(torch.int64).contiguous()
    snaps = torch.empty((N, snapshots, HV, K, V) if snapshots else (0,), dtype=f32)
    o = torch.empty_like(v)
    extension().gdr_forward(q, k, v, g, beta, state, cu_seqlens.to(torch.int64).contiguous(), idx, o, snaps,
                             float(scale), bool(use_qk_l2norm))
    return o[None], state, (snaps if snapshots else None)
