"""The gated delta rule and the short causal conv, in every form an engine needs.

- reference.py: float64 token loop, the specification
- recurrent.py: per-token step in torch ops (decode, any device)
- chunk.py:     chunked WY/UT form (long prefills, differentiable)
- fused.py:     the C++ CPU kernels (csrc/): the one-pass delta rule with its state in L1, and more
- conv.py:      short causal depthwise conv with its state
- api.py:       the dispatcher: checks, reset, in-place, packed sequences, snapshots
"""

from .api import BACKENDS, gated_delta_rule
from .conv import causal_conv1d
from .reference import l2norm

__all__ = ["BACKENDS", "gated_delta_rule", "causal_conv1d", "l2norm"]
