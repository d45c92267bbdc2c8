"""Memory outside torch's allocator: what glibc keeps of the temporaries freed while a checkpoint loads,
huge-page regions the weights themselves are carved from, and zeroed memory that is resident only once written
(caches)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap
import threading
import weakref

import torch

from deltaserve.ops import fused

_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc mallopt parameters
_NEVER_TRIM = (1 << 31) - 1  # (mallopt takes an int)
_GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@contextlib.contextmanager
def loading_memory():
    """While weights load, every tensor passes through a float32 temporary (dequantised before it is stored
    in 16 or 8 bits). glibc raises its mmap threshold to the size of the first large block freed, after
    which temporaries below 32 MB come from the heap and stay resident once freed: up to 0.7 GB more peak
    memory for a 0.8B model, varying run to run. Inside this context blocks from 1 MB go through mmap and
    back to the system when freed; after it the threshold is glibc's maximum and the heap is no longer trimmed
    (the activations of a run reuse heap blocks: no page faults), and the load's freed heap pages are returned
    once. Elsewhere than glibc: no effect. After it, tensors of 1-32 MB come from a range of their own
    (ops/csrc/blocks.h: in the heap, small allocations split the holes they leave, and the heap grew by 100 MB
    in prefills whose blocks were 37 MB at most).

    Why not trim: trimmed, the heap's top went back to the system at the frees and every prefill chunk faulted
    its activations in again (4 prefills of 2,048 tokens of a 0.8B Q4_K_M model: 57-65k page faults; untrimmed
    2.5k, at the same peak RSS). Where the host of a VM takes back the memory its guest frees, such a fault
    cost ~20 us (fresh memory was written at 0.2-0.5 GB/s, pages the guest had used recently at 5 GB/s), and
    the prefill ran 1-12% faster with trimming off; in the minutes where faults were cheap, the same."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    release_file_pages()
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MAX_MMAP_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
            libc.malloc_trim(0)
        if fused.available():
            fused.extension().use_block_range()
        release_file_pages()


_MADV_DONTNEED = 4


def release_file_pages() -> int:
    """Drops from this process's resident set the pages it maps of files read-only and has never written (their
    contents are the file's): kB dropped. Importing torch runs code all over its libraries once (84 MB resident
    after the imports, 48 MB of it libtorch_cpu's code), and a load reads the checkpoint's mapped bytes once;
    without this those pages stay counted in the process's memory for its whole life. They remain in the page
    cache, and the pages a run executes fault back in (~25 MB over a 0.8B model's first prefill and decode, on
    this machine's minor faults; the Q4_K_M 0.8B model's peak RSS 842 -> 774 MB). Mappings with a page written
    (a library's relocated data, made read-only afterwards: Private_Dirty) keep theirs, since dropping a
    written private page would take its contents back to the file's. Off Linux: nothing."""
    libc = _glibc()
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return 0
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for span, perms, path, fields in _mappings(text):
        clean = fields.get("Private_Dirty", 1) == 0 and fields.get("Anonymous", 1) == 0
        if path.startswith("/") and "w" not in perms and clean and fields.get("Rss", 0) > 0:
            start, end = span
            if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
                dropped += fields["Rss"]
    return dropped


def _mappings(smaps: str):
    """(start, end), perms, path and the kB fields of each mapping in /proc/<pid>/smaps' text."""
    entry = None
    for line in smaps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and not parts[0].endswith(":"):  # "start-end perms offset dev inode [path]"
            if entry is not None:
                yield entry
            start, end = (int(a, 16) for a in parts[0].split("-"))
            entry = ((start, end), parts[1], parts[5] if len(parts) > 5 else "", {})
        elif entry is not None and len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            entry[3][parts[0][:-1]] = int(parts[1])
    if entry is not None:
        yield entry


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_HUGE_PAGE = 2 << 20
_REGION_BYTES = 256 << 20  # address space per region the weights are carved from (a larger weight: one of its own)
_region: tuple[weakref.ref, int] | None = None  # the region weights are carved from now, and its bytes carved
_region_lock = threading.Lock()


def weight_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a weight, carved (64-byte aligned) from a region of anonymous memory the
    kernel may back with 2 MB pages (Linux, THP "always" or "madvise"). Decode streams every weight once a token:
    with 4 KB pages the float16 GEMVs of a 0.8B model's layers reached 16-22 GB/s here, with 2 MB pages 22-25 (fewer
    TLB misses, and the hardware prefetchers stop at page ends). The weights share regions because a mapping of a
    few MB of its own is mostly not in 2 MB pages (its ends are not 2 MB aligned): a Q4_K_M 0.8B model's layer
    matrices had 118 of their 286 MB in huge pages, and cold Q4_K matrices of 4 MB streamed 25.9 GB/s against 30.7
    carved from one region (two Xeon cores). A region goes back to the system when every tensor carved from it is
    freed (each holds it), so a weight freed alone keeps its bytes until its neighbours go: use this for weights."""
    global _region
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    with _region_lock:
        buf, used = (_region[0](), _region[1]) if _region is not None else (None, 0)
        if buf is None or used + nbytes > len(buf):
            buf = _huge_mapping(max(_REGION_BYTES, nbytes + _HUGE_PAGE))
            used = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % _HUGE_PAGE  # carve from a 2 MB boundary
        _region = (weakref.ref(buf), (used + nbytes + 63) // 64 * 64)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=used).view(shape)  # keeps buf alive


def _huge_mapping(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (zero-filled, resident only where written) asking for 2 MB pages (shared anonymous
    memory would not take them)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages already faulted in stay small
    except OSError:
        pass  # THP off or unsupported: ordinary pages
    return buf


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages take memory only once written: a KV cache sized for max_len tokens
    in every slot costs what its sequences have filled, not its capacity (torch.zeros writes it all). Below
    2 MB, or off Linux, torch.zeros."""
    numel = math.prod(shape)
    if numel * dtype.itemsize < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private anonymous memory: zero-filled by the kernel, freed with the tensor
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)  # keeps buf alive
