"""Fused path: one pass over the tokens with the state kept hot, threads over (sequence, head, column block).

The kernels are C++ (csrc/: the delta rule, the conv, the decode layers, the GEMVs), compiled on first
use for this CPU with torch's extension builder and cached under ~/.cache/deltaserve. Where no compiler
is available, `available()` is False and "auto" dispatch uses the torch paths instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"  # module.cpp includes the kernel headers: one translation unit


@functools.cache
def extension():
    source = b"".join(f.read_bytes() for f in sorted(_CSRC.iterdir()) if f.suffix in (".cpp", ".h"))
    # -march=native code is only valid on this CPU: key the build by source, CPU and torch. DELTASERVE_MARCH
    # builds for another target instead (x86-64-v3: the AVX2 paths, which tests run on AVX-512 machines).
    march = os.environ.get("DELTASERVE_MARCH", "native")
    cpu = platform.processor() + _cpu_flags() + ("" if march == "native" else march)
    tag = hashlib.sha256(source + cpu.encode() + torch.__version__.encode() + b"omp").hexdigest()[:12]
    build = Path(os.environ.get("DELTASERVE_CACHE", Path.home() / ".cache" / "deltaserve")) / f"cpu_kernels_{tag}"
    return build_once(build, f"deltaserve_cpu_kernels_{tag}", _CSRC / "module.cpp",
                      ["-O3", f"-march={march}", "-ffast-math", "-fopenmp"], what="the CPU kernels for this processor")


def build_once(build: Path, name: str, source: Path, cflags: list[str], what: str):
    """The extension `name` compiled from `source` into `build`, or loaded from there when built before. One process
    compiles while the others wait, and a build that was killed (Ctrl-C during the first minute, a session ending)
    never blocks the next: torch's builder guards `build` with a plain lock file that a killed build leaves behind,
    and then waits on it forever; our lock is the kernel's (flock), released with its holder, so a torch lock file
    found while holding it is stale and is removed."""
    built = build / f"{name}.so"
    if built.is_file():  # built before: no builder needed (importing it and its ninja check cost ~0.5 s, 5 MB)
        module = _load(built, name)
        if module is not None:
            return module
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "deltaserve.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"deltaserve: waiting for another process compiling {what} in {build}", file=sys.stderr, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        if built.is_file():  # the process we waited for built it
            module = _load(built, name)
            if module is not None:
                return module
        (build / "lock").unlink(missing_ok=True)
        from torch.utils import cpp_extension

        # A fresh machine compiles for 35-95 s here, often mid-generation: say so, or it looks like a hang.
        print(f"deltaserve: compiling {what} (once per CPU and version: about a minute, cached in {build})",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
        print(f"deltaserve: {what} ready ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
        return module


def _load(path: Path, name: str):
    """The extension module at `path`, or None where it cannot be imported (a half-written or foreign file)."""
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:
        return None


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
    """True when the CPU kernel compiles and loads here (the result is cached per process); where it does not, says
    once why the torch paths run instead."""
    try:
        extension()
        return True
    except Exception as e:  # no compiler, no ninja, unsupported platform: the torch paths still work
        reason = str(e).strip().splitlines()
        print(f"deltaserve: the CPU kernels are not available ({reason[0] if reason else type(e).__name__}); running "
              "on torch's operators instead, many times slower", file=sys.stderr, flush=True)
        return False


def fused(q, k, v, g, beta, *, scale, state, cu_seqlens, snapshots, use_qk_l2norm, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV(, K)]; beta [B, T, HV], the B * T tokens holding all
    sequences in order ([1, T] when packed); cu_seqlens [N + 1] int64 on CPU; state [S, HV, K, V] float32,
    advanced in place: sequence n owns row state_indices[n] (row n when None). The kernel reads q, k and v
    where they lie when it can (slices of a projection) and converts the rest itself.
    Returns (o [B, T, HV, V] float32; state; snaps [N, snapshots, HV, K, V] | None)."""
    if not q.is_cpu:
        raise ValueError(f"backend='fused' runs on CPU tensors only, got device {q.device}")
    N, (_, HV, K, V) = cu_seqlens.numel() - 1, state.shape
    o = torch.empty(v.shape, dtype=torch.float32)
    snaps = torch.empty((N, snapshots, HV, K, V), dtype=torch.float32) if snapshots else EMPTY_F32
    extension().gdr_forward(q, k, v, g, beta, state, cu_seqlens, state_indices, o, snaps, float(scale),
                            bool(use_qk_l2norm))
    return o, state, (snaps if snapshots else None)


def inplace_step(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm):
    """gated_delta_rule's common call (float32 CPU tensors, no autograd, B sequences of T tokens, the state
    advanced in place, see gdr_inplace in csrc/delta_rule.h) checked and run in one C++ call: o, or None
    for any other call (then the general path runs it, or names what is wrong)."""
    try:
        return extension().gdr_inplace(q, k, v, g, beta, state, state_indices,
                                       None if scale is None else float(scale), bool(use_qk_l2norm))
    except (TypeError, ValueError):  # arguments pybind cannot take (not tensors, ...): the general path's to name
        return None


# Empty placeholders the kernel reads as "absent" (never written).
EMPTY_I64 = torch.empty(0, dtype=torch.int64)
EMPTY_F32 = torch.empty(0, dtype=torch.float32)


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the linear kernels read it (csrc/xrows.h): rows of contiguous floats, any distance apart (the MLP's
    down projection reads swiglu's product written over the gate half of gate_up: a copy would be 7 MB at 512
    tokens)."""
    return x if x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) else x.contiguous()


@functools.lru_cache(maxsize=64)
def dense_cu_seqlens(B: int, T: int) -> torch.Tensor:
    """Offsets of B sequences of T tokens each, [0, T, 2T, ...] (shared: callers must not write it)."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int64)
