"""KimiModel against transformers' Kimi-Linear (float32, eager, torch fallback kernels) on tiny random
checkpoints, and the KDA layer's chunked prefill against its own token-by-token decode.

Sizes are odd on purpose: 3 KDA heads but 4 MLA heads, latent rank 20 with nope 12 / rope 6 / value 14.
Every weight is randomised, including A_log, dt_bias, every norm and the expert-score bias, so a wrong
sign, a swapped projection or a dropped bias changes the logits. The second variant adds q low-rank,
grouped routing, two shared experts, two leading dense layers and a kernel-3 conv.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import ARCHITECTURES, KimiModel, load_model
from deltaserve.models.kimi import KimiConfig
from deltaserve.models.kimi import KimiDeltaAttention

LIN, FULL = "linear_attention", "full_attention"

_BASE = dict(
    vocab_size=307, hidden_size=72, intermediate_size=40, moe_intermediate_size=20, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6,
    v_head_dim=14, num_experts=6, num_experts_per_tok=2, routed_scaling_factor=2.446, linear_head_dim=10,
    linear_num_heads=3, rms_norm_eps=1e-5, layer_types=[LIN, LIN, FULL, LIN, FULL],
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
VARIANTS = {
    "plain": dict(q_lora_rank=None, n_shared_experts=1, mlp_layer_types=["dense"] + ["sparse"] * 4),
    "q-lora-grouped": dict(q_lora_rank=18, n_shared_experts=2, n_group=2, topk_group=1, linear_conv_kernel_dim=3,
                           mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"]),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal(t, mean, std):
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2.5 - 1.5)  # exp(A_log) in [0.22, 2.7]
            elif name.endswith("dt_bias"):
                normal(p, 0.0, 0.5)
            elif "norm" in name:  # every Kimi norm is a plain multiplier
                normal(p, 1.0, 0.3)
            elif "embed_tokens" in name:
                normal(p, 0.0, 1.0)
            elif "conv1d" in name:
                normal(p, 0.0, 0.4)
            else:
                normal(p, 0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                normal(b, 0.0, 0.3)  # the size of the sigmoid scores: it changes which experts win


@dataclass
class TinyKimi:
    variant: str
    model: torch.nn.Module  # transformers, float32, eager
    path: str  # save_pretrained directory: Moonshot's tensor names


def build_tiny(variant: str, path) -> TinyKimi:
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**_BASE, **VARIANTS[variant])).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    randomise(model, seed=list(VARIANTS).index(variant) + 11)
    model.save_pretrained(path)
    return TinyKimi(variant, model, str(path))


@pytest.fixture(scope="session", params=list(VARIANTS))
def tiny_kimi(request, tmp_path_factory) -> TinyKimi:
    return build_tiny(request.param, tmp_path_factory.mktemp(f"kimi-{request.param}"))


@pytest.fixture(scope="module")
def ours(tiny_kimi) -> KimiModel:
    return KimiModel.from_checkpoint(open_checkpoint(tiny_kimi.path))


def reference_logits(tiny: TinyKimi, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tiny.model(ids, use_cache=False).logits.float()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def test_config_read_from_the_checkpoint(tiny_kimi, ours):
    cfg = ours.config
    assert cfg.layer_types == (LIN, LIN, FULL, LIN, FULL)
    dense = 1 if tiny_kimi.variant == "plain" else 2
    assert cfg.ffn_types == ("dense",) * dense + ("moe",) * (5 - dense)
    assert (cfg.kda_heads, cfg.kda_head_dim, cfg.num_heads, cfg.kv_lora_rank) == (3, 10, 4, 20)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (12, 6, 14)
    assert cfg.routed_scaling_factor == pytest.approx(2.446) and cfg.norm_topk_prob
    assert cfg.mla_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5  # transformers' kv_a_layernorm keeps 1e-6
    assert type(load_model(open_checkpoint(tiny_kimi.path))) is KimiModel
    assert ARCHITECTURES["kimi-linear"] is ARCHITECTURES["kimi_linear"] is KimiModel


def test_prefill_logits_match_transformers(tiny_kimi, ours):
    ids = torch.randint(0, 307, (2, 23), generator=torch.Generator().manual_seed(1))
    ref = reference_logits(tiny_kimi, ids)
    state = ours.new_state(2, 32)
    got = ours(ids, state, [0, 1], logits="all")
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-4
    assert state.lengths.tolist() == [23, 23]

    last = ours(ids, ours.new_state(2, 32), torch.tensor([1, 0]), logits="last")
    assert last.shape == (2, 307) and rel_err(last, ref[:, -1]) < 1e-4


def test_greedy_after_chunked_prefill_matches_transformers(tiny_kimi, ours):
    prompt = torch.randint(0, 307, (1, 17), generator=torch.Generator().manual_seed(2))
    n_new = 32

    expected = prompt  # transformers, recomputing the whole sequence at every step
    for _ in range(n_new):
        nxt = reference_logits(tiny_kimi, expected)[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, nxt], dim=1)

    state = ours.new_state(1, 64)
    chunks = [ours(prompt[:, a:b], state, [0], logits="all") for a, b in ((0, 5), (5, 12), (12, 17))]
    one_shot = ours(prompt, ours.new_state(1, 64), [0], logits="all")
    assert rel_err(torch.cat(chunks, dim=1), one_shot) < 1e-5

    tokens, logits = prompt, chunks[-1][:, -1]
    for _ in range(n_new):
        nxt = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = ours(nxt, state, [0])
    assert tokens.tolist() == expected.tolist()
    assert len(set(expected[0, 17:].tolist())) > 3  # the comparison is not of one repeated token
    assert int(state.lengths[0]) == 17 + n_new


def test_state_layout_and_reset(ours):
    cfg = ours.config
    state = ours.new_state(2, 16)
    assert state.max_len == 16
    assert state.conv[0].shape == (2, cfg.conv_kernel - 1, 3 * 3 * 10)  # [q | k | v] conv rows
    assert state.ssm[0].shape == (2, 3, 10, 10) and state.ssm[0].dtype == torch.float32
    assert state.k[2].shape == (2, 16, 1, 20 + 6) and state.v[2].numel() == 0  # the latent is stored once
    ids = torch.randint(0, 307, (1, 7), generator=torch.Generator().manual_seed(4))
    first = ours(ids, state, [1])
    state.reset([1])
    assert torch.equal(ours(ids, state, [1]), first)  # a reset slot starts over exactly


def test_bfloat16_weights_stay_close(tiny_kimi):
    model = KimiModel.from_checkpoint(open_checkpoint(tiny_kimi.path), dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    kda, moe = model.layers[0], model.layers[-1]
    assert kda.input_norm.weight.dtype == kda.mixer.A.dtype == kda.mixer.dt_bias.dtype == torch.float32
    assert moe.ffn.router.weight.dtype == moe.ffn.expert_bias.dtype == torch.float32
    assert moe.ffn.experts.gate_up.dtype == moe.mixer.kv_b.dtype == torch.bfloat16
    ids = torch.randint(0, 307, (2, 11), generator=torch.Generator().manual_seed(5))
    ref = reference_logits(tiny_kimi, ids)
    got = model(ids, model.new_state(2, 11), [0, 1], logits="all")
    # bf16 rounding may flip a near-tied expert, so the typical error is the measure (as for Qwen)
    assert float((got - ref).abs().median() / ref.abs().max()) < 2e-2


def test_forward_rejects_bad_input(ours):
    state = ours.new_state(2, 8)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(DeltaserveError, match="distinct"):
        ours(ids, state, [1, 1])
    with pytest.raises(DeltaserveError, match="token ids"):
        ours(ids + 307, state, [0, 1])
    ours(torch.zeros(1, 6, dtype=torch.long), state, [1])
    with pytest.raises(DeltaserveError, match="max_len 8"):
        ours(ids, state, [0, 1])
    assert state.lengths.tolist() == [0, 6]


# -- the KDA layer on its own -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def kda(ours) -> KimiDeltaAttention:
    return ours.layers[0].mixer


# 41 tokens: past the 32 up to which devices without the fused kernel take the recurrent path
@pytest.mark.parametrize("splits", [(1,) * 41, (37, 4), (1, 33, 2, 5)], ids=["token-by-token", "two-chunks", "mixed"])
def test_kda_chunked_prefill_equals_token_by_token(ours, kda, splits):
    cfg, slots = ours.config, torch.tensor([2, 0])
    x = torch.randn(2, 41, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    W, C = cfg.conv_kernel, 3 * cfg.kda_dim

    def fresh():
        gen = torch.Generator().manual_seed(7)  # a non-zero starting state, as after an earlier chunk
        return torch.randn(3, W - 1, C, generator=gen), torch.randn(3, 3, 10, 10, generator=gen) * 0.3

    conv_all, ssm_all = fresh()
    whole = kda(x, conv_all, ssm_all, slots)
    conv, ssm = fresh()
    parts, start = [], 0
    for n in splits:
        parts.append(kda(x[:, start:start + n], conv, ssm, slots))
        start += n
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_all, rtol=1e-5, atol=1e-5)  # the last W-1 inputs either way
    torch.testing.assert_close(ssm, ssm_all, rtol=1e-5, atol=1e-5)
    untouched = fresh()
    assert torch.equal(conv[1], untouched[0][1]) and torch.equal(ssm[1], untouched[1][1])
    # the conv state holds the projected q | k | v inputs of the last W-1 tokens
    qkv = kda.in_proj(x[:, -(W - 1):])[..., :C]
    torch.testing.assert_close(conv[slots], qkv, rtol=1e-6, atol=1e-6)


def test_kda_decay_matches_transformers_gates(kda):
    """The plain gate against transformers' Kimi forget gate, the bounded one against GLM-5-Next's."""
    H, D, E = kda.H, kda.D, kda.in_proj.in_features
    hidden = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(8))
    f_a = kda.in_proj.weight[3 * H * D:3 * H * D + D]
    A_log = torch.log(-kda.A)
    for lower in (None, -4.5):
        shape = SimpleNamespace(linear_head_dim=D, linear_num_heads=H, hidden_size=E, linear_lower_bound=lower)
        gate = KimiLinearForgetGate(shape) if lower is None else Glm5NextTextForgetGate(shape)
        with torch.no_grad():
            gate.f_a_proj.weight.copy_(f_a)
            gate.f_b_proj.weight.copy_(kda.f_b.weight)
            gate.dt_bias.copy_(kda.dt_bias)
            gate.A_log.copy_(A_log.view(gate.A_log.shape))
            kda.lower_bound = lower
            try:
                ours = kda.decay(kda.f_b(hidden @ f_a.T))
            finally:
                kda.lower_bound = None
            torch.testing.assert_close(ours, gate(hidden), rtol=1e-5, atol=1e-6)
        if lower is not None:
            assert (ours >= lower).all() and (ours < 0).all()


def test_bounded_gate_is_read_from_the_config():
    raw = dict(_BASE, model_type="kimi_linear", mlp_layer_types=None, layer_types=None, first_k_dense_replace=1,
               linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3, 5], "head_dim": 10,
                                   "num_heads": 3, "short_conv_kernel_size": 4, "gate_lower_bound": -3.0})
    cfg = KimiConfig.from_hf(raw)
    assert cfg.gate_lower_bound == -3.0 and cfg.layer_types == (LIN, LIN, FULL, LIN, FULL)
    assert cfg.ffn_types == ("dense", "moe", "moe", "moe", "moe") and cfg.conv_kernel == 4
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "gate_lower_bound": None, "safe_gate": True}
    assert KimiConfig.from_hf(raw).gate_lower_bound == -5.0
