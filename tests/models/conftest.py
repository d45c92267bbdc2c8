"""Tiny random transformers checkpoints of the three Qwen hybrid families (the independent reference).

Sizes are odd on purpose: K != V, HV = 2H, partial rotary, head_dim != hidden / heads. Every weight is
randomised, including A_log, dt_bias and the zero-centred norms, so a missed `1 + w` or a wrong head
order changes the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

_COMMON = dict(
    vocab_size=307, hidden_size=72, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=24, linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=10,
    linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)


def _build(family: str):
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**_COMMON, intermediate_size=40, moe_intermediate_size=24,
                              shared_expert_intermediate_size=28, num_experts=5, num_experts_per_tok=2,
                              norm_topk_prob=True)
        return Qwen3NextForCausalLM(cfg)
    if family == "qwen3_5":
        cfg = Qwen3_5TextConfig(**_COMMON, intermediate_size=40, tie_word_embeddings=True)
        return Qwen3_5ForCausalLM(cfg)
    cfg = Qwen3_5MoeTextConfig(**_COMMON, moe_intermediate_size=26, shared_expert_intermediate_size=22,
                               num_experts=6, num_experts_per_tok=2)
    return Qwen3_5MoeForCausalLM(cfg)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal(p, mean, std):
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2.5 - 1.0)  # A in [0.37, 4.5]
            elif name.endswith("dt_bias"):
                normal(p, 0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # the GDN output norm is a plain multiplier
                normal(p, 1.0, 0.3)
            elif "norm" in name:  # zero-centred: the multiplier is 1 + w
                normal(p, 0.0, 0.3)
            elif "embed_tokens" in name:
                normal(p, 0.0, 1.0)
            elif "lm_head" in name:
                normal(p, 0.0, 0.4)
            elif "conv1d" in name:
                normal(p, 0.0, 0.4)
            else:
                normal(p, 0.0, 0.15)


@dataclass
class TinyCheckpoint:
    family: str
    model: torch.nn.Module  # transformers, float32, eager attention
    path: str  # save_pretrained directory (safetensors)


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request, tmp_path_factory) -> TinyCheckpoint:
    family = request.param
    torch.manual_seed(0)
    model = _build(family).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # grouped_mm needs 16-byte strides; ours are odd
    _randomise(model, seed=FAMILIES.index(family) + 1)
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return TinyCheckpoint(family, model, str(path))
