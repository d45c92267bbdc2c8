"""The tiled attention kernel (ops/csrc/attention.h) against the float64 specification on odd shapes:
spans that are no multiple of the 64-key tile, GQA groups 1, 2 and 4, head sizes 64 / 128 / 256 and K != V,
with and without a cached prefix, float16 and float32 caches, decode steps (where the keys are split
across threads), a value cache that is a slice of the key rows (Kimi's latent cache), the 0.8B model's shapes
over a long span, and the AVX2 / portable builds."""

import pytest
import torch

from deltaserve.ops import fused
from deltaserve.ops.attention import attention_cached, attention_reference, kernel_applies
from tests.builds import run_in_build

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not compile here")


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():  # the kernel serves inference only
        yield


def _case(N, T, nh, nkv, dk, dv, prefix, dtype, slots=None, seed=0):
    """Random q and caches with the new tokens written after `prefix` cached ones; rows past them hold NaN
    (never read)."""
    g = torch.Generator().manual_seed(seed)
    n_slots = max(slots) + 1 if slots else N
    L = max(prefix) + T + 5
    k_cache = torch.full((n_slots, L, nkv, dk), float("nan")).to(dtype)
    v_cache = torch.full((n_slots, L, nkv, dv), float("nan")).to(dtype)
    slots = torch.tensor(slots or list(range(N)))
    start = torch.tensor(prefix)
    for n in range(N):
        span = prefix[n] + T
        k_cache[slots[n], :span] = (torch.randn(span, nkv, dk, generator=g) * 2).to(dtype)
        v_cache[slots[n], :span] = torch.randn(span, nkv, dv, generator=g).to(dtype)
    q = torch.randn(N, T, nh, dk, generator=g) * 2
    return q, k_cache, v_cache, slots, start


def _check(q, k_cache, v_cache, slots, start, scale):
    assert kernel_applies(q, k_cache, v_cache)
    got = attention_cached(q, k_cache, v_cache, slots, start, scale)
    want = attention_reference(q, k_cache, v_cache, slots, start, scale)
    err = (got.double() - want).abs().max().item()
    assert err < 2e-5, f"max |diff| {err:.2e}"


@pytest.mark.parametrize("nh, nkv, hd", [(4, 2, 64), (8, 2, 256), (6, 6, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_without_prefix(nh, nkv, hd, dtype):
    q, kc, vc, slots, start = _case(1, 63, nh, nkv, hd, hd, [0], dtype)
    _check(q, kc, vc, slots, start, hd ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_after_prefix_two_sequences(dtype):
    # 2 sequences in slots 3 and 1, prefixes 130 and 7 (no tile multiple), K = 96 != V = 80, group 2
    q, kc, vc, slots, start = _case(2, 63, 4, 2, 96, 80, [130, 7], dtype, slots=[3, 1])
    _check(q, kc, vc, slots, start, 0.11)


@pytest.mark.parametrize("nh, nkv", [(8, 2), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_over_long_cache_split_across_the_context(nh, nkv, dtype):
    # one query token over 1,000 cached keys: few (sequence, kv head) items, so the keys are split
    q, kc, vc, slots, start = _case(1, 1, nh, nkv, 128, 128, [1000], dtype)
    _check(q, kc, vc, slots, start, 128 ** -0.5)


def test_decode_batch_of_unequal_lengths():
    q, kc, vc, slots, start = _case(3, 1, 4, 1, 64, 64, [300, 0, 777], torch.float16, slots=[2, 0, 1])
    _check(q, kc, vc, slots, start, 0.125)


def test_values_as_a_slice_of_the_key_rows():
    """Kimi's MLA cache: one kv head whose rows are [latent (64) | rope key (32)], values = the latent."""
    q, kc, _, slots, start = _case(1, 37, 3, 1, 96, 96, [70], torch.float32)
    _check(q, kc, kc[..., :64], slots, start, 96 ** -0.5)


def test_long_prefix_chunk_matches_whole_prompt():
    """A 2,049-token prompt fed as chunks of 512 gives the same outputs as one pass (the softmax carried
    over many tiles), each against the reference."""
    q, kc, vc, slots, start = _case(1, 2049, 4, 2, 64, 64, [0], torch.float16)
    whole = attention_cached(q, kc, vc, slots, start, 0.125)
    for t0 in range(0, 2049, 512):
        part = attention_cached(q[:, t0:t0 + 512], kc, vc, slots, torch.tensor([t0]), 0.125)
        assert torch.allclose(part, whole[:, t0:t0 + 512], atol=1e-5)
    want = attention_reference(q[:, -63:], kc, vc, slots, torch.tensor([2049 - 63]), 0.125)
    assert (whole[:, -63:].double() - want).abs().max() < 2e-5


def test_bad_arguments_are_named():
    q, kc, vc, slots, start = _case(1, 5, 4, 2, 64, 64, [0], torch.float32)
    with pytest.raises(RuntimeError, match="outside the caches"):
        attention_cached(q, kc, vc, slots, torch.tensor([kc.shape[1]]), 0.1)
    with pytest.raises(RuntimeError, match="nh a multiple of nkv"):
        attention_cached(q[:, :, :3], kc, vc, slots, start, 0.1)


@pytest.mark.parametrize("T", [3, 5])  # 12 query rows (dot products) or 20 (the wide score kernel)
def test_a_few_tokens_over_a_long_cache_split_across_the_context(T):
    """A speculative verify pass: a few query tokens of one kv head, keys split across threads; the first
    tokens see none of the keys past them in the last split."""
    q, kc, vc, slots, start = _case(1, T, 4, 1, 64, 48, [900], torch.float16)
    _check(q, kc, vc, slots, start, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_span_at_the_model_shapes(dtype):
    """Qwen3.5 0.8B's attention (8 query heads on 2 kv heads, head 256): 33 new tokens after 3,000 cached, 3,033
    keys (no multiple of the 64-key tile); 132 query rows a kv head, so the score kernel takes 64 + 64 + 16
    rows."""
    q, kc, vc, slots, start = _case(1, 33, 8, 2, 256, 256, [3000], dtype, seed=3)
    _check(q, kc, vc, slots, start, 256 ** -0.5)


@pytest.mark.parametrize("T", [10, 37])  # 40 / 148 query rows: 48 (three registers), or 128 + 32 in two tiles
def test_head_sizes_off_the_register_width(T):
    """K = 72 and V = 40 (the value kernel's last register of columns half full), group 4, float16 cache."""
    q, kc, vc, slots, start = _case(2, T, 8, 2, 72, 40, [517, 64], torch.float16, slots=[1, 0], seed=T)
    _check(q, kc, vc, slots, start, 72 ** -0.5)


@pytest.mark.parametrize("prefix", [0, 3, 66])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
def test_every_tail_of_the_register_blocks(T, prefix):
    """Group 2, so 2T query rows; spans of 1 - 74 keys: the AVX2 kernels' blocks of 6 keys and of 6 rows, with the
    last 4 or 2 of either apart (rows and keys are rounded up to 4), over full and half-full registers of columns."""
    q, kc, vc, slots, start = _case(1, T, 4, 2, 48, 40, [prefix], torch.float16, seed=T + prefix)
    _check(q, kc, vc, slots, start, 48 ** -0.5)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["avx2", "portable"])
def test_other_builds_of_the_kernel(march):
    """On an AVX-512 machine the plain loops (no AVX-512 register kernels) are built for x86-64-v3 and -v2
    (DELTASERVE_MARCH) and run the tests above."""
    run_in_build(__file__, march, "not other_builds")
