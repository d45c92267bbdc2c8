"""The allocator of mid-sized CPU tensors (ops/csrc/blocks.h): which tensors it holds, that freed runs are reused
and joined (its high-water mark, against hand-computed sizes), and that tensors from it hold what torch computes."""

import threading

import pytest
import torch

from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels cannot be built here")
MB = 1 << 20


@pytest.fixture(scope="module")
def ext():
    ext = fused.extension()
    if not ext.use_block_range():
        pytest.skip("no address range could be reserved here")
    return ext


def test_which_tensors_it_holds(ext):
    _, live = ext.block_range_usage()
    small, large = torch.empty(64 << 10, dtype=torch.uint8), torch.empty(32 * MB, dtype=torch.uint8)
    assert ext.block_range_usage()[1] == live  # below 256 KB and from 32 MB: torch's own allocator
    mid = torch.empty(3 * MB + 5, dtype=torch.uint8)
    held = ext.block_range_usage()[1] - live
    assert 3 * MB + 5 <= held <= 3 * MB + 5 + 8192  # whole pages, the block up to 4032 bytes into its run
    assert mid.data_ptr() % 64 == 0
    del mid
    assert ext.block_range_usage()[1] == live
    del small, large


def test_freed_runs_are_reused_and_joined(ext):
    first = torch.empty(12 * MB, dtype=torch.uint8)
    top = ext.block_range_usage()[0]
    del first
    blocks = [torch.empty(4 * MB - 8192, dtype=torch.uint8) for _ in range(3)]
    assert ext.block_range_usage()[0] == top  # in the run just freed: the range did not grow
    del blocks
    again = torch.empty(12 * MB - 8192, dtype=torch.uint8)  # fits only in the three runs joined again
    assert ext.block_range_usage()[0] == top
    del again


def test_tensors_from_it_compute_as_from_torch(ext):
    torch.manual_seed(0)
    a, b = torch.randn(700, 600, dtype=torch.float64), torch.randn(600, 900, dtype=torch.float64)
    expected = (a.numpy() @ b.numpy())
    for _ in range(3):
        assert torch.allclose(a @ b, torch.from_numpy(expected), rtol=1e-12, atol=1e-10)
        a, b = a.clone(), b.clone()  # 3.4 and 4.3 MB: new blocks each round


def test_threads_allocating_at_once(ext):
    _, live = ext.block_range_usage()
    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.full((int(torch.randint(64 << 10, 1 << 20, (1,), generator=g)),), float(seed))
            if not bool((x == seed).all()):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and ext.block_range_usage()[1] == live
