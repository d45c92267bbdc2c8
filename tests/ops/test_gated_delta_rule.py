"""Every path of gated_delta_rule against the float64 reference loop (deltaserve/ops/reference.py)."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.ops import gated_delta_rule
from deltaserve.ops.reference import gated_delta_rule_reference

# (H, HV, K, V): K != V and grouped value heads (HV = 2H, 4H) so layout bugs cannot hide behind squares.
SHAPES = {"H2-HV2-K16-V16": (2, 2, 16, 16), "H2-HV4-K16-V24": (2, 4, 16, 24), "H1-HV4-K32-V20": (1, 4, 32, 20)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(B, T, H, HV, K, V, per_channel=False, dtype=torch.float32, seed=0, N=None):
    gen = torch.Generator().manual_seed(seed)
    r = functools.partial(torch.randn, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    # log-decays mostly in (-1, 0) with a tail of strong decays (exercises the masked exponent differences)
    g = -(r(B, T, HV, K) if per_channel else r(B, T, HV)).exp() * 0.3
    beta = torch.rand(B, T, HV, generator=gen)
    state = r(N or B, HV, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [state]


def reference(q, k, v, g, beta, state, cu_seqlens=None, snapshots=0, scale=None, l2=True):
    B, T = q.shape[:2]
    bounds = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
              [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    return gated_delta_rule_reference(q, k, v, g, beta, scale=scale or q.shape[-1] ** -0.5, initial_state=state,
                                      seq_bounds=bounds, snapshots=snapshots, use_qk_l2norm=l2)


def assert_close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def assert_matches_reference(backend, q, k, v, g, beta, state, snapshots):
    """Output, final state and snapshots of one call (q/k L2-normalised) within 2e-4 of the float64 loop."""
    expected = reference(q, k, v, g, beta, state, snapshots=snapshots)
    got = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, snapshots=snapshots,
                           backend=backend)
    for actual, want in zip(got, expected):
        assert_close(actual, want, 2e-4)


@functools.cache
def cached_case(T, shape, per_channel, dtype_name):
    inputs = make_inputs(2, T, *SHAPES[shape], per_channel=per_channel, dtype=DTYPES[dtype_name], seed=T)
    return inputs, reference(*inputs, snapshots=3)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 500], ids=lambda t: f"T{t}")
def test_matches_reference(backend, T, shape, gate, dtype_name):
    (q, k, v, g, beta, state), (o_ref, s_ref, snaps_ref) = cached_case(T, shape, gate == "per_channel", dtype_name)
    o, s, snaps = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, snapshots=3,
                                   backend=backend)
    assert o.dtype == v.dtype and o.shape == v.shape
    assert s.dtype == torch.float32 and s.shape == state.shape
    assert_close(o, o_ref, 1e-2 if dtype_name == "bf16" else 2e-4)
    assert_close(s, s_ref, 2e-4)
    assert_close(snaps, snaps_ref, 2e-4)


@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
def test_without_l2norm_and_custom_scale(backend, gate):
    q, k, v, g, beta, state = make_inputs(2, 37, 2, 4, 16, 24, per_channel=gate == "per_channel")
    k = k / 16 ** 0.5  # keep beta * |k|^2 < 2 so the un-normalised recurrence stays stable
    o_ref, s_ref, _ = reference(q, k, v, g, beta, state, scale=0.3, l2=False)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=state, scale=0.3, backend=backend)
    assert_close(o, o_ref, 2e-4)
    assert_close(s, s_ref, 2e-4)


def test_zero_initial_state_by_default(backend):
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 2, 16, 16)
    o_ref, s_ref, _ = reference(q, k, v, g, beta, torch.zeros(1, 2, 16, 16))
    o, s = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, backend=backend)
    assert_close(o, o_ref, 2e-4)
    assert_close(s, s_ref, 2e-4)


@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
@pytest.mark.parametrize("lens", [(5, 70, 1, 33), (0, 9, 2), (64,), (250, 7, 300, 0, 20)],
                         ids=lambda l: "lens" + "-".join(map(str, l)))
def test_packed_sequences_equal_separate_calls(backend, lens, gate):
    H, HV, K, V = 2, 4, 16, 24
    T = sum(lens)
    q, k, v, g, beta, state = make_inputs(1, T, H, HV, K, V, per_channel=gate == "per_channel", N=len(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, s, snaps = gated_delta_rule(q, k, v, g, beta, initial_state=state, cu_seqlens=cu, use_qk_l2norm=True,
                                   snapshots=4, backend=backend)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        parts = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_n, s_n, snaps_n = reference(*parts, state[n:n + 1], snapshots=4)
        assert_close(o[:, a:b], o_n, 2e-4)
        assert_close(s[n:n + 1], s_n, 2e-4)
        assert_close(snaps[n:n + 1], snaps_n, 2e-4)  # shorter than 4 tokens: older entries = initial state


@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
@pytest.mark.parametrize("V", [24, 64], ids=lambda v: f"V{v}")
def test_extreme_gates(backend, gate, V):
    """No decay for a long stretch, then decays that underflow exp(g) to 0: the state is forgotten exactly."""
    q, k, v, g, beta, state = make_inputs(1, 300, 2, 4, 16, V, per_channel=gate == "per_channel")
    g[:, :100] = 0.0
    g[:, 150:160] = -60.0    # exp(-60) ~ 1e-26: below float32's normal range after a few tokens
    g[:, 200] = -1e4         # exp underflows to exactly 0
    g[:, 250:] = -1e-3
    assert_matches_reference(backend, q, k, v, g, beta, state, snapshots=3)


@pytest.mark.parametrize("garbage", [1e9, float("nan"), float("inf")], ids=["1e9", "nan", "inf"])
def test_reset_ignores_stale_state(backend, garbage):
    q, k, v, g, beta, state = make_inputs(3, 17, 2, 4, 16, 24)
    state[1] = garbage
    reset = torch.tensor([False, True, False])
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=state, reset=reset, use_qk_l2norm=True, backend=backend)
    fresh = state.clone()
    fresh[1] = 0
    o_ref, s_ref, _ = reference(q, k, v, g, beta, fresh)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close(o, o_ref, 2e-4)
    assert_close(s, s_ref, 2e-4)


@pytest.mark.parametrize("splits", [(1, 1, 5, 64, 29), (100,), (1,) * 100], ids=["mixed", "whole", "single_steps"])
def test_split_calls_equal_one_call(backend, splits):
    q, k, v, g, beta, state = make_inputs(2, 100, 2, 4, 16, 24, per_channel=True)
    o_ref, s_ref, _ = reference(q, k, v, g, beta, state)
    s, outs, t = state.clone(), [], 0
    for n in splits:
        o, s = gated_delta_rule(*(x[:, t:t + n] for x in (q, k, v, g, beta)), initial_state=s, use_qk_l2norm=True,
                                backend=backend)
        outs.append(o)
        t += n
    assert_close(torch.cat(outs, 1), o_ref, 2e-4)
    assert_close(s, s_ref, 2e-4)


def test_inplace_writes_the_slot(backend):
    q, k, v, g, beta, state = make_inputs(2, 40, 2, 4, 16, 24)
    slot = state.clone()
    o1, s1 = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, backend=backend)
    o2, s2 = gated_delta_rule(q, k, v, g, beta, initial_state=slot, use_qk_l2norm=True, inplace=True,
                              backend=backend)
    assert s2 is slot
    assert torch.equal(state, make_inputs(2, 40, 2, 4, 16, 24)[5])  # not in place: input untouched
    assert_close(o2, o1, 1e-6)
    assert_close(slot, s1, 1e-6)


def test_inplace_on_a_view_of_a_cache(backend):
    """A cache holds many slots; writing through a strided view must only touch that slot."""
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, 4, 16, 24)
    cache = torch.randn(4, 4, 16, 24).transpose(0, 1)  # [HV, slots, ...] storage: slot views are strided
    before = cache.clone()
    view = cache[:, 2:3].transpose(0, 1)
    _, s_ref, _ = reference(q, k, v, g, beta, view.clone())
    gated_delta_rule(q, k, v, g, beta, initial_state=view, use_qk_l2norm=True, inplace=True, backend=backend)
    assert_close(cache[:, 2:3].transpose(0, 1), s_ref, 2e-4)
    keep = [0, 1, 3]
    assert torch.equal(cache[:, keep], before[:, keep])


def test_long_run_stays_close_to_float64(backend):
    q, k, v, g, beta, state = make_inputs(1, 8192, 1, 2, 16, 16, per_channel=False)
    o_ref, s_ref, _ = reference(q, k, v, g, beta, state)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, backend=backend)
    assert_close(o, o_ref, 5e-4)
    assert_close(s, s_ref, 5e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 3), T=st.integers(1, 80), H=st.integers(1, 3), groups=st.integers(1, 3),
       K=st.integers(1, 40), V=st.integers(1, 70), per_channel=st.booleans(), snapshots=st.integers(0, 5),
       seed=st.integers(0, 2 ** 16))
def test_property_random_shapes(backend, B, T, H, groups, K, V, per_channel, snapshots, seed):
    q, k, v, g, beta, state = make_inputs(B, T, H, H * groups, K, V, per_channel=per_channel, seed=seed)
    ref = reference(q, k, v, g, beta, state, snapshots=snapshots)
    out = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, snapshots=snapshots,
                           backend=backend)
    for a, b in zip(out, ref):
        if b is not None:
            assert_close(a, b, 3e-4)


def test_chunk_gradients_match_reference():
    """Training differentiates through the chunked form: its float64 gradients must equal the loop's."""
    from deltaserve.ops.chunk import chunk

    inputs = [x.double() for x in make_inputs(1, 11, 1, 2, 4, 3, per_channel=True)]
    inputs = [x.requires_grad_() for x in inputs]
    f64_state = inputs.pop()

    def f_chunk(q, k, v, g, beta, s):
        o, final, _ = chunk(q, k, v, g, beta, scale=0.5, state=s, snapshots=0, use_qk_l2norm=True, chunk_size=4)
        return o, final

    def f_ref(q, k, v, g, beta, s):
        o, final, _ = gated_delta_rule_reference(q, k, v, g, beta, scale=0.5, initial_state=s,
                                                 seq_bounds=[(0, 0, 11)], use_qk_l2norm=True)
        return o, final

    assert torch.autograd.gradcheck(f_chunk, (*inputs, f64_state))
    o1, s1 = f_chunk(*inputs, f64_state)
    o2, s2 = f_ref(*inputs, f64_state)
    w1, w2 = torch.randn_like(o1), torch.randn_like(s1)
    g1 = torch.autograd.grad((o1 * w1).sum() + (s1 * w2).sum(), inputs)
    g2 = torch.autograd.grad((o2 * w1).sum() + (s2 * w2).sum(), inputs)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_auto_prefers_chunk_when_gradients_are_needed():
    from deltaserve.ops.api import choose_backend

    q = torch.zeros(1, 1, 1, 1)
    assert choose_backend(q, 4096, needs_grad=True) == "chunk"


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(1, 5, 2, 16)), r"q, k must both be \[B, T, H, K\].*q \(1, 5, 2, 16\)"),
    (dict(v=torch.zeros(1, 4, 3, 24)), r"HV = 3 value heads, not a multiple of H = 2"),
    (dict(beta=torch.zeros(1, 4, 2)), r"beta must be \[B, T, HV\] = \[1, 4, 4\].*\(1, 4, 2\)"),
    (dict(g=torch.zeros(1, 4, 4, 8)), r"g must be \[B, T, HV\] or \[B, T, HV, K\]"),
    (dict(initial_state=torch.zeros(1, 4, 24, 16)), r"initial_state must be \[N, HV, K, V\] = \[1, 4, 16, 24\]"),
    (dict(initial_state=torch.zeros(1, 4, 16, 24, dtype=torch.float64)), r"initial_state must be float32"),
    (dict(q=torch.zeros(1, 4, 2, 16, dtype=torch.int64)), r"q must be a floating-point tensor"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), r"cu_seqlens must rise from 0 to T = 4"),
    (dict(snapshots=-1), r"snapshots must be a non-negative int"),
    (dict(backend="cuda_magic"), r"backend must be one of"),
    (dict(reset=torch.tensor([1])), r"reset must be a bool tensor \[N\] = \[1\]"),
], ids=["q_shape", "hv_multiple", "beta_shape", "g_shape", "state_shape", "state_dtype", "int_q", "cu_seqlens",
        "snapshots", "backend", "reset"])
@pytest.mark.parametrize("inplace", [False, True], ids=["new_state", "inplace"])  # inplace: C++-checked first
def test_bad_arguments_name_what_is_wrong(bad, match, inplace):
    q, k, v, g, beta, _ = make_inputs(1, 4, 2, 4, 16, 24)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    kwargs = dict(initial_state=torch.zeros(1, 4, 16, 24), inplace=True) if inplace else {}
    for name, value in bad.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(*args.values(), **kwargs)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_state_indices_update_only_their_cache_slots(backend, packed):
    """Decode of 3 sequences living in slots 4, 0, 2 of a 5-slot cache: the other slots stay untouched."""
    T = 1 if not packed else 7
    q, k, v, g, beta, _ = make_inputs(1 if packed else 3, T if not packed else 3 * T, 2, 4, 16, 24, per_channel=True)
    cache = torch.randn(5, 4, 16, 24)
    before = cache.clone()
    slots = torch.tensor([4, 0, 2])
    cu = torch.tensor([0, T, 2 * T, 3 * T]) if packed else None
    o_ref, s_ref, snaps_ref = reference(q, k, v, g, beta, before[slots], cu_seqlens=cu, snapshots=2)
    o, out, snaps = gated_delta_rule(q, k, v, g, beta, initial_state=cache, state_indices=slots, cu_seqlens=cu,
                                     inplace=True, use_qk_l2norm=True, snapshots=2, backend=backend)
    assert out is cache
    assert_close(o, o_ref, 2e-4)
    assert_close(cache[slots], s_ref, 2e-4)
    assert_close(snaps, snaps_ref, 2e-4)
    assert torch.equal(cache[[1, 3]], before[[1, 3]])


def test_state_indices_with_reset(backend):
    q, k, v, g, beta, _ = make_inputs(2, 5, 2, 4, 16, 24)
    cache = torch.randn(4, 4, 16, 24)
    cache[3] = float("nan")
    expected_start = cache[[1, 3]].clone()
    expected_start[1] = 0
    o_ref, s_ref, _ = reference(q, k, v, g, beta, expected_start)
    o, _ = gated_delta_rule(q, k, v, g, beta, initial_state=cache, state_indices=torch.tensor([1, 3]),
                            reset=torch.tensor([False, True]), inplace=True, use_qk_l2norm=True, backend=backend)
    assert_close(o, o_ref, 2e-4)
    assert_close(cache[[1, 3]], s_ref, 2e-4)


@pytest.mark.parametrize("idx, match", [
    (torch.tensor([0, 0]), "must be distinct"),
    (torch.tensor([0, 9]), r"must lie in \[0, 4\)"),
    (torch.tensor([0, 1], dtype=torch.int32), "must be an int64 tensor"),
], ids=["duplicate", "out_of_range", "int32"])
def test_bad_state_indices(idx, match):
    q, k, v, g, beta, _ = make_inputs(2, 3, 2, 4, 16, 24)
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(4, 4, 16, 24), state_indices=idx, inplace=True)


@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
@pytest.mark.parametrize("V", [64, 192], ids=lambda v: f"V{v}")
def test_value_widths_in_blocks_of_64(backend, V, gate):
    """Real head sizes (V a multiple of 64) take the fused kernel's register-blocked sweep."""
    q, k, v, g, beta, state = make_inputs(2, 70, 2, 4, 128, V, per_channel=gate == "per_channel")
    assert_matches_reference(backend, q, k, v, g, beta, state, snapshots=2)


@pytest.mark.parametrize("B, T", [(1, 1), (3, 1), (2, 37)], ids=["one_token", "batch_of_tokens", "batch"])
def test_slices_of_one_projection(backend, B, T):
    """q, k, v as models pass them: views into one wider row per token (the fused kernel reads them in place)."""
    H, HV, K, V = 2, 4, 16, 24
    q, k, v, g, beta, state = make_inputs(B, T, H, HV, K, V, seed=5)
    wide = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2), torch.full((B, T, 7), float("nan"))], dim=-1)
    views = [x.view(B, T, n, d) for x, n, d in zip(wide.split([H * K, H * K, HV * V, 7], dim=-1), (H, H, HV), (K, K, V))]
    assert views[0].is_contiguous() == (B * T == 1)  # one token's slice counts as contiguous
    assert_matches_reference(backend, *views, g, beta, state, snapshots=2)


FAST_PATH_CASES = {  # (kwargs, inputs changed): the common in-place call, and calls it must leave to the general path
    "decode": (dict(), None),
    "cache_slots": (dict(state_indices=torch.tensor([3, 0])), None),
    "custom_scale_no_l2norm": (dict(scale=0.3, use_qk_l2norm=False), None),
    "bf16_inputs": (dict(), "bf16"),
    "requires_grad": (dict(), "grad"),
    "strided_state": (dict(), "strided"),
}


@pytest.mark.parametrize("gate", ["headwise", "per_channel"])
@pytest.mark.parametrize("T", [1, 63], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("case", FAST_PATH_CASES)
def test_inplace_calls_take_the_checked_kernel_call(case, T, gate, monkeypatch):
    """An in-place call on float32 CPU tensors without autograd is checked and run in one C++ call (what a
    model's decode makes); any other call falls through to the general path. Both against the float64 loop."""
    from deltaserve.ops import fused
    if not fused.available():
        pytest.skip("fused CPU kernel did not compile here (no C++ compiler or ninja)")
    kwargs, change = FAST_PATH_CASES[case]
    kwargs = dict(dict(use_qk_l2norm=True), **kwargs)
    q, k, v, g, beta, _ = make_inputs(2, T, 2, 4, 16, 24, per_channel=gate == "per_channel", seed=T)
    cache = torch.randn(4, 4, 16, 24) if "state_indices" in kwargs else torch.randn(2, 4, 16, 24)
    if change == "strided":
        cache = torch.randn(2, 4, 24, 16).transpose(2, 3)  # [N, HV, K, V] with a transposed layout
    if change == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    if not kwargs["use_qk_l2norm"]:  # unit-scale keys, as the l2norm would give: the state stays bounded
        q, k = q / 4, k / 4
    rows = kwargs.get("state_indices", torch.arange(2)).long()
    expected = reference(q, k, v, g, beta, cache[rows].clone(), scale=kwargs.get("scale"),
                         l2=kwargs["use_qk_l2norm"])
    if change == "grad":
        q.requires_grad_(True)
    ext, ran = fused.extension(), []

    class Spy:  # the kernel module, noting whether the checked call ran
        def __getattr__(self, name):
            return getattr(ext, name)

        def gdr_inplace(self, *args):
            out = ext.gdr_inplace(*args)
            ran.append(out is not None)
            return out

    monkeypatch.setattr(fused, "extension", Spy)
    o, state = gated_delta_rule(q, k, v, g, beta, initial_state=cache, inplace=True, **kwargs)
    assert ran == [case in ("decode", "cache_slots", "custom_scale_no_l2norm")]
    assert state is cache and o.dtype == v.dtype
    tol = 2e-4 if change != "bf16" else 2e-2
    assert_close(o.detach(), expected[0], tol)
    assert_close(cache[rows], expected[1], tol)
