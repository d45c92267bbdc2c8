"""causal_conv1d against torch's own conv1d (an independent implementation) on the full history."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import causal_conv1d


def torch_reference(history, weight, bias, silu=True):
    """history [T, C] including the state rows; returns the conv over all of it, [T - (W-1), C]."""
    C, W = weight.shape
    y = F.conv1d(history.double().T[None], weight.double()[:, None], None if bias is None else bias.double(),
                 groups=C)[0].T
    return F.silu(y) if silu else y


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("W", [2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1, 2, 3, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("C", [13, 150], ids=lambda c: f"C{c}")  # the one-token kernel works in blocks of 64
def test_matches_conv1d_with_state(conv_backend, C, T, W, with_bias):
    B = 2
    x, w, state = torch.randn(B, T, C), torch.randn(C, W), torch.randn(B, W - 1, C)
    bias = torch.randn(C) if with_bias else None
    y, new_state = causal_conv1d(x, w, bias, conv_state=state, backend=conv_backend)
    for b in range(B):
        history = torch.cat([state[b], x[b]])
        torch.testing.assert_close(y[b].double(), torch_reference(history, w, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_state[b], history[-(W - 1):])


def test_no_state_means_zero_history(conv_backend):
    x, w = torch.randn(1, 9, 6), torch.randn(6, 4)
    y, s = causal_conv1d(x, w, activation=None, backend=conv_backend)
    ref = torch_reference(torch.cat([torch.zeros(3, 6), x[0]]), w, None, silu=False)
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[0], x[0, -3:])


def test_split_calls_equal_one_call(conv_backend):
    x, w, state = torch.randn(2, 30, 7), torch.randn(7, 4), torch.randn(2, 3, 7)
    y_all, s_all = causal_conv1d(x, w, conv_state=state, backend="torch")
    s, ys = state.clone(), []
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 30)]:
        y, s = causal_conv1d(x[:, a:b], w, conv_state=s, inplace=True, backend=conv_backend)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_all)
    torch.testing.assert_close(s, s_all)


@pytest.mark.parametrize("lens", [(4, 1, 9), (0, 2, 5), (1, 1, 1, 1)], ids=lambda l: "lens" + "-".join(map(str, l)))
def test_packed_equals_separate(conv_backend, lens):
    C, W = 5, 4
    T = sum(lens)
    x, w, state = torch.randn(1, T, C), torch.randn(C, W), torch.randn(len(lens), W - 1, C)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, new_state = causal_conv1d(x, w, conv_state=state, cu_seqlens=cu, backend=conv_backend)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_n, s_n = causal_conv1d(x[:, a:b], w, conv_state=state[n:n + 1], backend="torch")
        torch.testing.assert_close(y[:, a:b], y_n)
        torch.testing.assert_close(new_state[n:n + 1], s_n)


def test_reset_ignores_garbage_and_inplace_writes_slot(conv_backend):
    x, w = torch.randn(3, 5, 4), torch.randn(4, 4)
    state = torch.randn(3, 3, 4)
    state[0] = float("nan")
    expected_y, expected_s = causal_conv1d(x, w, conv_state=torch.cat([torch.zeros(1, 3, 4), state[1:]]),
                                           backend="torch")
    y, s = causal_conv1d(x, w, conv_state=state, reset=torch.tensor([True, False, False]), inplace=True,
                         backend=conv_backend)
    assert s is state
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(state, expected_s)


def test_bfloat16_input_keeps_dtype(conv_backend):
    x, w = torch.randn(1, 6, 8, dtype=torch.bfloat16), torch.randn(8, 4)
    y, _ = causal_conv1d(x, w, backend=conv_backend)
    assert y.dtype == torch.bfloat16
    ref = torch_reference(torch.cat([torch.zeros(3, 8), x[0].float()]), w, None)
    torch.testing.assert_close(y[0].double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=torch.zeros(2, 5)), r"x must be \[B, T, C\]"),
    (dict(weight=torch.zeros(5, 4)), r"weight must be \[C, W\] with C = 6"),
    (dict(conv_state=torch.zeros(1, 4, 6)), r"conv_state must be \[N, W-1, C\] = \[1, 3, 6\]"),
    (dict(activation="gelu"), r"activation must be None or 'silu'"),
    (dict(inplace=True), r"inplace=True needs a conv_state"),
    (dict(out=torch.zeros(1, 5, 7)), r"out must have x's shape, dtype and device"),
], ids=["x_rank", "weight", "state", "activation", "inplace", "out"])
def test_bad_arguments(kwargs, match):
    args = dict(x=torch.zeros(1, 5, 6), weight=torch.zeros(6, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(args.pop("x"), args.pop("weight"), **args)


@pytest.mark.parametrize("T", [1, 3], ids=lambda t: f"T{t}")
def test_state_indices_update_only_their_slots(conv_backend, T):
    x, w = torch.randn(2, T, 5), torch.randn(5, 4)
    cache = torch.randn(4, 3, 5)
    before = cache.clone()
    slots = torch.tensor([3, 1])
    y_ref, s_ref = causal_conv1d(x, w, conv_state=before[slots], backend="torch")
    y, out = causal_conv1d(x, w, conv_state=cache, state_indices=slots, inplace=True, backend=conv_backend)
    assert out is cache
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(cache[slots], s_ref)
    assert torch.equal(cache[[0, 2]], before[[0, 2]])


def test_gradients_flow_through_auto_and_match_conv1d():
    """Training calls the conv with backend='auto': it must take a differentiable path."""
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y, _ = causal_conv1d(x, w)
    ref = torch.stack([torch_reference(torch.cat([torch.zeros(3, 5, dtype=torch.float64), x[b]]), w, None)
                       for b in range(2)])
    g = torch.randn_like(ref)
    grads = torch.autograd.grad((y * g).sum(), (x, w))
    expected = torch.autograd.grad((ref * g).sum(), (x, w))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="without gradients"):
        causal_conv1d(x, w, backend="fused")


@pytest.mark.parametrize("T", [1, 6], ids=lambda t: f"T{t}")
def test_input_sliced_from_a_wider_projection(conv_backend, T):
    B, C, W = 2, 70, 4
    wide = torch.randn(B, T, C + 9)
    x, w, state = wide[..., :C], torch.randn(C, W), torch.randn(B, W - 1, C)
    y, new_state = causal_conv1d(x, w, conv_state=state, backend=conv_backend)
    for b in range(B):
        history = torch.cat([state[b], x[b]])
        torch.testing.assert_close(y[b].double(), torch_reference(history, w, None), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_state[b], history[-(W - 1):])


@pytest.mark.parametrize("T", [1, 6], ids=lambda t: f"T{t}")
def test_output_over_its_input(conv_backend, T):
    """out=x: the conv writes over its input (a slice of a wider row), as a model's decode and prefill do."""
    B, C, W = 2, 70, 4
    wide = torch.randn(B, T, C + 9)
    x, w, state = wide[..., :C], torch.randn(C, W), torch.randn(B, W - 1, C)
    expected, expected_state = causal_conv1d(x.clone(), w, conv_state=state.clone(), backend="torch")
    tail = wide[..., C:].clone()
    y, new_state = causal_conv1d(x, w, conv_state=state, backend=conv_backend, out=x)
    assert y.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, expected_state)
    assert torch.equal(wide[..., C:], tail)  # the rest of each row untouched
