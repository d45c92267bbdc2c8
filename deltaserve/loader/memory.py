"""Memory outside torch's allocator: what glibc keeps of the temporaries freed while a checkpoint loads,
huge-page memory for the weights themselves, and zeroed memory that is resident only once written (caches)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap

import torch

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@contextlib.contextmanager
def loading_memory():
    """While weights load, every tensor passes through a float32 temporary (dequantised before it is stored
    in 16 or 8 bits). glibc raises its mmap threshold to the size of the first large block freed, after
    which temporaries below 32 MB come from the heap and stay resident once freed: up to 0.7 GB more peak
    memory for a 0.8B model, varying run to run. Inside this context blocks from 1 MB go through mmap and
    back to the system when freed; after it the threshold is glibc's maximum (the activations of a run reuse
    heap blocks, no page faults), and freed heap pages are returned. Elsewhere than glibc: no effect."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MAX_MMAP_THRESHOLD)
            libc.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_HUGE_MIN_BYTES = 2 << 20  # one huge page


def weight_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a weight, in memory the kernel may back with 2 MB pages (Linux, THP
    "always" or "madvise"). Decode streams every weight once a token: with 4 KB pages the float16 GEMVs of a
    0.8B model's layers reached 16-22 GB/s here, with 2 MB pages 22-25 (fewer TLB misses, and the hardware
    prefetchers stop at page ends). The memory goes back to the system when the tensor is freed."""
    return _anonymous(shape, dtype, huge=True)


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages take memory only once written: a KV cache sized for max_len tokens
    in every slot costs what its sequences have filled, not its capacity (torch.zeros writes it all)."""
    return _anonymous(shape, dtype, huge=False, zeroed=True)


def _anonymous(shape, dtype: torch.dtype, huge: bool, zeroed: bool = False) -> torch.Tensor:
    """Private anonymous memory (zero-filled by the kernel, freed with the tensor); below 2 MB, or off Linux,
    the ordinary allocator."""
    numel = math.prod(shape)
    if numel * dtype.itemsize < _HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype) if zeroed else torch.empty(shape, dtype=dtype)
    # private: shared anonymous memory would not take THP
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages already faulted in stay small
        except OSError:
            pass  # THP off or unsupported: ordinary pages
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # keeps buf alive
