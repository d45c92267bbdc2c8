"""Weights in huge-page memory: ordinary tensors to every op, private to each, returned when freed; file pages
read once leave the resident set."""

import ctypes
import gc
import hashlib
import mmap
import os
import resource
from pathlib import Path

import numpy as np
import pytest
import torch

from deltaserve.loader.memory import _glibc, _mappings, loading_memory, release_file_pages, weight_empty


def _anon_huge_kb() -> int | None:
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    return int(text.split("AnonHugePages:")[1].split()[0])


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((1100, 1024), torch.float16),
                                          ((4099, 1024), torch.int8)], ids=["small", "f16_2MB", "int8_4MB"])
def test_weight_memory_holds_values(shape, dtype):
    src = torch.randint(-100, 100, shape).to(dtype)
    a, b = weight_empty(shape, dtype).copy_(src), weight_empty(shape, dtype).copy_(src)
    a[0, 0] = 7  # private memory: b does not see it
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert torch.equal(b, src) and a[0, 0] == 7 and torch.equal(a.flatten()[1:], src.flatten()[1:])
    assert torch.equal((a.float() @ torch.ones(shape[1])), a.float().sum(1))  # ops read it like any tensor


def test_huge_pages_where_the_kernel_offers_them():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text() or _anon_huge_kb() is None:
        pytest.skip("no transparent huge pages on this machine")
    before = _anon_huge_kb()
    w = weight_empty((16 << 20,), torch.uint8)
    w.fill_(1)
    assert _anon_huge_kb() - before >= 8 << 10  # most of 16 MB in 2 MB pages (the ends may stay small)
    del w
    gc.collect()
    assert _anon_huge_kb() - before < 2 << 10  # returned to the system


def test_weights_of_a_few_mb_share_huge_pages():
    """A model's layer matrices are a few MB each: carved one after another from one region, most of their bytes
    are 2 MB pages, where a mapping each (ends not 2 MB aligned) left most of them in 4 KB pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text() or _anon_huge_kb() is None:
        pytest.skip("no transparent huge pages on this machine")
    before = _anon_huge_kb()
    weights = [weight_empty((1536 * 1024 + 100,), torch.uint8).fill_(i) for i in range(20)]  # 30 MB, 1.5 MB each
    assert all(w.data_ptr() % 64 == 0 for w in weights)
    assert all(int(w[0]) == i and int(w[-1]) == i for i, w in enumerate(weights))  # no two overlap
    assert _anon_huge_kb() - before >= 24 << 10
    del weights
    gc.collect()
    assert _anon_huge_kb() - before < 2 << 10  # the region went back with its last tensor


def test_a_weight_larger_than_a_region_has_its_own():
    big = weight_empty(((300 << 20) // 4,), torch.float32)  # past the 256 MB a region spans
    small = weight_empty((1000,), torch.float32)
    big[-1], small[0] = 1.5, 2.5
    assert big.numel() == (300 << 20) // 4 and float(big[-1]) == 1.5 and float(small[0]) == 2.5


def test_after_loading_a_pass_reuses_the_memory_the_last_one_freed():
    """A prefill chunk's activations (a few MB each, made and freed layer by layer) come back from the heap on
    the next chunk: no page faults (trimmed, each pass faulted its ~3,600 pages in again)."""
    if _glibc() is None:
        pytest.skip("not glibc: its allocator is left as it is")
    with loading_memory():
        pass

    def layer_pass():
        for mb in (8, 4, 14, 2, 8):
            t = torch.ones(mb << 18)  # written: every page touched
            del t

    for _ in range(3):  # the heap grows to hold a pass (its free blocks settle in two or three)
        layer_pass()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        layer_pass()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 200


def _resident_kb(address: int) -> int | None:
    """Rss of the mapping holding address (/proc/self/smaps), None off Linux."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    return next(f.get("Rss", 0) for (lo, hi), _, _, f in _mappings(text) if lo <= address < hi)


def _written(path: Path, data: bytes) -> Path:
    with open(path, "wb") as f:  # on disk: page-cache pages not yet written back count as dirty
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path


def test_pages_of_a_file_read_once_leave_the_resident_set(tmp_path):
    """A read-only mapping of a file (as a checkpoint's, or a library's code) read through: its pages are dropped,
    and reading it again gives the file's bytes."""
    if _glibc() is None or not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps or no glibc here")
    path = _written(tmp_path / "data.bin", os.urandom(8 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        try:
            first = hashlib.sha256(view).hexdigest()  # every page read
            address = view.ctypes.data
            assert _resident_kb(address) >= 7 << 10
            assert release_file_pages() >= 7 << 10
            assert _resident_kb(address) == 0
            assert hashlib.sha256(view).hexdigest() == first == hashlib.sha256(path.read_bytes()).hexdigest()
        finally:
            del view


def test_a_read_only_mapping_with_written_pages_keeps_them(tmp_path):
    """A library's relocated data is a private file mapping written and then made read-only: dropping its pages
    would bring back the file's bytes, so it is left alone."""
    libc = _glibc()
    if libc is None or not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps or no glibc here")
    path = _written(tmp_path / "data.bin", bytes(1 << 20))
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        m[4096] = 7  # a private copy of that page
        cell = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(cell)
        try:
            assert libc.mprotect(address, len(m), mmap.PROT_READ) == 0
            release_file_pages()
            assert m[4096] == 7 and _resident_kb(address) > 0
        finally:
            libc.mprotect(address, len(m), mmap.PROT_READ | mmap.PROT_WRITE)
            del cell
