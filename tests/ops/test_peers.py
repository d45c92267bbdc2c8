"""Parity with the peers' published pure-torch references (transformers' Qwen3-Next and Kimi-Linear).

They run on CPU only where flash-linear-attention is absent: with it, transformers dispatches to Triton.
"""

import importlib.util

import pytest
import torch

from deltaserve.ops import gated_delta_rule

from .test_gated_delta_rule import make_inputs

if importlib.util.find_spec("fla") is not None:
    pytest.skip("flash-linear-attention is installed: transformers would call its GPU kernels", allow_module_level=True)
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


@pytest.mark.parametrize("peer", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T{t}")
def test_qwen3_next_reference(backend, peer, T):
    q, k, v, g, beta, state = make_inputs(2, T, 2, 4, 16, 24)
    o_peer, s_peer = getattr(qwen3_next, peer)(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, backend=backend)
    torch.testing.assert_close(o, o_peer, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(s, s_peer, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("peer", ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"])
@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T{t}")
def test_kimi_linear_reference(backend, peer, T):
    q, k, v, g, beta, state = make_inputs(2, T, 3, 3, 16, 24, per_channel=True)  # KDA: one k head per v head
    o_peer, s_peer = getattr(kimi, peer)(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, backend=backend)
    torch.testing.assert_close(o, o_peer, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(s, s_peer, rtol=2e-4, atol=2e-4)
