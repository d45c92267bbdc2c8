"""Kimi Linear (kimi-linear / kimi_linear): Kimi Delta Attention layers interleaved with rope-less MLA.

KDA is the gated delta rule with a decay per key channel; MLA caches one compressed latent per token and
absorbs the key/value up-projections into the query and the output. Each layer is followed by a dense
SwiGLU MLP (the leading layers) or a sigmoid-routed MoE. `KimiModel.forward` advances a batch of sequences
held in `HybridState` slots (models/base.py). Everything a checkpoint format does differently is in
`KimiModel.weight_table`, read forwards to load and backwards to write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.models.base import HybridModel, conv_tape
from deltaserve.models.kimi.config import KimiConfig
from deltaserve.models.layers import MLP, Linear, RMSNorm, SigmoidMoE, cached_attention
from deltaserve.models.weights import NEG_EXP, Param, cat, either, leaf, reshape, stack, transpose
from deltaserve.ops import causal_conv1d, gated_delta_rule


class KimiDeltaAttention(nn.Module):
    """q, k, v each through its own short causal conv (one depthwise conv over [q | k | v] is the same),
    then the gated delta rule with beta = sigmoid(b) and a per-channel log-decay from a low-rank f_b(f_a(x));
    output = out_proj(RMSNorm(o) * sigmoid(g_b(g_a(x)))) per head."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.H, self.D = H, D = cfg.kda_heads, cfg.kda_head_dim
        self.lower_bound = cfg.gate_lower_bound
        # rows: q (H*D) | k (H*D) | v (H*D) | f_a (D) | g_a (D) | b (H)
        self.in_proj = Linear(cfg.hidden_size, 3 * H * D + 2 * D + H, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * H * D, cfg.conv_kernel))
        self.f_b = Linear(D, H * D, bias=False)
        self.g_b = Linear(D, H * D, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * D))
        self.A = nn.Parameter(torch.empty(H))  # -exp(A_log), as GGUF stores it
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.out_proj = Linear(H * D, cfg.hidden_size, bias=False)

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """f [..., H*D] (f_b's output) -> float32 log-decay [..., H, D], always <= 0."""
        x = (f.float() + self.dt_bias).unflatten(-1, (self.H, self.D))
        A = self.A[:, None]  # [H, 1]
        if self.lower_bound is None:
            return A * F.softplus(x)
        return self.lower_bound * torch.sigmoid(-A * x)  # bounded below by lower_bound

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                slots: torch.Tensor | None = None, snapshots: int = 0):
        """x [N, T, E]; sequence n continues cache row slots[n] of conv_state [S, W-1, 3*H*D] and
        ssm_state [S, H, D, D], both updated in place. snapshots=K > 0: returns (y, conv_tape(...)
        [N, W-1+T, 3*H*D], ssm [N, K, H, D, D] the states after each of the last K tokens, newest first)."""
        N, T, _ = x.shape
        H, D = self.H, self.D
        qkv, f, gate, b = self.in_proj(x).split([3 * H * D, D, D, H], dim=-1)
        tape = conv_tape(conv_state, slots, qkv) if snapshots else None
        qkv, _ = causal_conv1d(qkv, self.conv_weight, conv_state=conv_state, state_indices=slots, inplace=True,
                               activation="silu")
        q, k, v = (t.view(N, T, H, D) for t in qkv.split(H * D, dim=-1))
        beta = torch.sigmoid(b.float())  # [N, T, H]
        g = self.decay(self.f_b(f))  # [N, T, H, D]
        o, _, *ssm_snaps = gated_delta_rule(q, k, v, g, beta, initial_state=ssm_state, state_indices=slots,
                                            inplace=True, snapshots=snapshots, use_qk_l2norm=True)
        o = self.norm(o, gate=self.g_b(gate).view(N, T, H, D), gate_act="sigmoid", inplace=True)
        y = self.out_proj(o.reshape(N, T, H * D))
        return (y, tape, ssm_snaps[0]) if snapshots else y


class LatentAttention(nn.Module):
    """Multi-head latent attention without rotary embedding, over a cache of [latent | shared key] per token.

    Per head, key = [k_b c | k_pe] and value = v_b c, with c = RMSNorm(latent). Folding k_b into the query
    (q_nope k_b) and v_b into the output lets every head attend to the cached rows themselves: one kv head
    whose keys are [c | k_pe] and whose values are c.
    """

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        E, nh = cfg.hidden_size, cfg.num_heads
        self.nh, self.dn, self.dr, self.R = nh, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q_dim = nh * (self.dn + self.dr)
        self.q_low_rank = bool(cfg.q_lora_rank)
        if self.q_low_rank:
            self.q_a = Linear(E, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
            self.q_b = Linear(cfg.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = Linear(E, q_dim, bias=False)
        self.kv_a = Linear(E, self.R + self.dr, bias=False)  # rows: latent (R) | shared key (dr)
        self.kv_a_norm = RMSNorm(self.R, cfg.mla_norm_eps)
        self.kv_b = nn.Parameter(torch.empty(nh, self.dn + cfg.v_head_dim, self.R))  # per head [k_b | v_b] rows
        self.o_proj = Linear(nh * cfg.v_head_dim, E, bias=False)
        self.scale = (self.dn + self.dr) ** -0.5  # of the expanded heads, which the absorption leaves unchanged

    def forward(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """x [N, T, E]; cache [S, max_len, 1, R + dr] rows of [c | k_pe]; start [N] tokens already cached."""
        N, T, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.q_low_rank else self.q_proj(x)
        q_nope, q_pe = q.view(N, T, self.nh, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.R, self.dr], dim=-1)
        kv = torch.cat([self.kv_a_norm(latent), k_pe], dim=-1)[:, :, None]  # [N, T, 1, R + dr]
        k_b, v_b = self.kv_b.to(q_nope.dtype).split([self.dn, self.kv_b.shape[1] - self.dn], dim=1)  # stored narrower
        q = torch.cat([torch.einsum("nthd,hdr->nthr", q_nope, k_b), q_pe], dim=-1)  # [N, T, nh, R + dr]
        # values are the first R channels of each cached row: a view, so the cache holds c only once
        o = cached_attention(q, kv, kv[..., :self.R], cache, cache[..., :self.R], slots, start, self.scale)
        o = torch.einsum("nthr,hvr->nthv", o, v_b)  # [N, T, nh, dv]
        return self.o_proj(o.reshape(N, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, index: int):
        super().__init__()
        self.recurrent = cfg.layer_types[index] == "linear_attention"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = KimiDeltaAttention(cfg) if self.recurrent else LatentAttention(cfg)
        if cfg.ffn_types[index] == "moe":
            self.ffn = SigmoidMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                  cfg.shared_intermediate_size, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                  cfg.n_group, cfg.topk_group)
        else:
            self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size)


class KimiModel(HybridModel):
    config_class = KimiConfig
    gguf_archs = ("kimi-linear",)
    hf_model_types = ("kimi_linear",)
    keep_fp32 = ("norm.weight", ".A", ".dt_bias", "conv_weight", "router.weight", "expert_bias")

    def make_layer(self, config: KimiConfig, index: int) -> nn.Module:
        return DecoderLayer(config, index)

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Per slot: KDA conv rows [q | k | v] and delta-rule states; MLA rows [c | k_pe] in `k`. `v` has
        width 0 because the values are the first kv_lora_rank channels of those rows."""
        cfg = self.config
        return dict(conv=(cfg.conv_kernel - 1, 3 * cfg.kda_dim), ssm=(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim),
                    k=(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), v=(1, 0))

    def attend(self, layer, x, rope, k_cache, v_cache, slots, start):
        return layer.mixer(x, k_cache, slots, start)

    # -- the checkpoint contract --------------------------------------------------------------------

    @classmethod
    def weight_table(cls, cfg: KimiConfig, hf_root: str = "model.") -> list[Param]:
        """Moonshot's release layout first (q/k/v_conv1d, f_a_proj on self_attn, dense layers as mlp.*, MoE
        layers as block_sparse_moe.experts.{j}.w1/w2/w3), then the names transformers saves (fused conv1d,
        forget_gate.*, everything under block_sparse_moe.* or mlp.*, fused experts). Norms are plain
        multipliers; A_log is [1, 1, H, 1]; kv_b_proj holds per head [k_nope | v] rows. llama.cpp's
        (conversion/kimi_linear.py): ssm_a = -exp(A_log), convs {W, 1, C, 1}, the post-attention norm as
        ffn_norm, kv_b split into attn_k_b (k_b transposed) and attn_v_b (or the legacy attn_kv_b)."""
        E, V = cfg.hidden_size, cfg.vocab_size
        table = [Param("embed.weight", leaf(hf_root + "embed_tokens.weight", V, E), leaf("token_embd.weight", V, E))]
        for i, kind in enumerate(cfg.layer_types):
            src, b, dst = f"{hf_root}layers.{i}.", f"blk.{i}.", f"layers.{i}."
            table += [Param(dst + "input_norm.weight", leaf(src + "input_layernorm.weight", E),
                            leaf(b + "attn_norm.weight", E)),
                      Param(dst + "post_norm.weight", leaf(src + "post_attention_layernorm.weight", E),
                            leaf(b + "ffn_norm.weight", E))]
            mixer = _kda_table if kind == "linear_attention" else _mla_table
            table += mixer(cfg, src + "self_attn.", b, dst + "mixer.")
            ffn = _mlp_table if cfg.ffn_types[i] == "dense" else _moe_table
            table += ffn(cfg, src, b, dst + "ffn.")
        table.append(Param("norm.weight", leaf(hf_root + "norm.weight", E), leaf("output_norm.weight", E)))
        if not cfg.tie_word_embeddings:
            table.append(Param("lm_head.weight", leaf("lm_head.weight", V, E), leaf("output.weight", V, E)))
        return table


def _kda_table(cfg: KimiConfig, a: str, b: str, m: str) -> list[Param]:
    E, H, D, W = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    C = H * D

    def gate(name: str, *shape: int, **kw):  # Moonshot keeps the decay's weights on self_attn, transformers
        return either(leaf(a + name, *shape, **kw), leaf(a + "forget_gate." + name, *shape, **kw))

    def conv(name: str, channels: int):
        return leaf(name, channels, 1, W, fn=reshape((channels, 1, W), (channels, W)))

    return [
        Param(m + "in_proj.weight",  # rows q | k | v | f_a | g_a | b
              cat(leaf(a + "q_proj.weight", C, E), leaf(a + "k_proj.weight", C, E), leaf(a + "v_proj.weight", C, E),
                  gate("f_a_proj.weight", D, E), leaf(a + "g_a_proj.weight", D, E), leaf(a + "b_proj.weight", H, E)),
              cat(leaf(b + "attn_q.weight", C, E), leaf(b + "attn_k.weight", C, E), leaf(b + "attn_v.weight", C, E),
                  leaf(b + "ssm_f_a.weight", D, E), leaf(b + "ssm_g_a.weight", D, E), leaf(b + "ssm_beta.weight", H, E))),
        Param(m + "conv_weight", either(cat(*(conv(f"{a}{x}_conv1d.weight", C) for x in "qkv")),
                                        conv(a + "conv1d.weight", 3 * C)),
              cat(*(leaf(f"{b}ssm_conv1d_{x}.weight", 1, C, 1, W, fn=reshape((1, C, 1, W), (C, W))) for x in "qkv"))),
        Param(m + "f_b.weight", gate("f_b_proj.weight", C, D), leaf(b + "ssm_f_b.weight", C, D)),
        Param(m + "g_b.weight", leaf(a + "g_b_proj.weight", C, D), leaf(b + "ssm_g_b.weight", C, D)),
        Param(m + "dt_bias", gate("dt_bias", C), leaf(b + "ssm_dt.bias", C)),
        Param(m + "A", gate("A_log", 1, 1, H, 1, fn=reshape((1, 1, H, 1), (H,)) >> NEG_EXP),
              leaf(b + "ssm_a", 1, 1, H, 1, fn=reshape((1, 1, H, 1), (H,)))),
        Param(m + "norm.weight", leaf(a + "o_norm.weight", D), leaf(b + "ssm_norm.weight", D)),
        Param(m + "out_proj.weight", leaf(a + "o_proj.weight", E, C), leaf(b + "attn_output.weight", E, C)),
    ]


def _mla_table(cfg: KimiConfig, a: str, b: str, m: str) -> list[Param]:
    E, nh, dn, dr, dv, R, Q = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                               cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank)
    if Q:
        table = [Param(m + "q_a.weight", leaf(a + "q_a_proj.weight", Q, E), leaf(b + "attn_q_a.weight", Q, E)),
                 Param(m + "q_a_norm.weight", leaf(a + "q_a_layernorm.weight", Q), leaf(b + "attn_q_a_norm.weight", Q)),
                 Param(m + "q_b.weight", leaf(a + "q_b_proj.weight", nh * (dn + dr), Q),
                       leaf(b + "attn_q_b.weight", nh * (dn + dr), Q))]
    else:
        table = [Param(m + "q_proj.weight", leaf(a + "q_proj.weight", nh * (dn + dr), E),
                       leaf(b + "attn_q.weight", nh * (dn + dr), E))]
    kv_b = reshape((nh * (dn + dv), R), (nh, dn + dv, R))
    return table + [
        Param(m + "kv_a.weight", leaf(a + "kv_a_proj_with_mqa.weight", R + dr, E),
              leaf(b + "attn_kv_a_mqa.weight", R + dr, E)),
        Param(m + "kv_a_norm.weight", leaf(a + "kv_a_layernorm.weight", R), leaf(b + "attn_kv_a_norm.weight", R)),
        Param(m + "kv_b", leaf(a + "kv_b_proj.weight", nh * (dn + dv), R, fn=kv_b),
              either(cat(leaf(b + "attn_k_b.weight", nh, R, dn, fn=transpose(1, 2)), leaf(b + "attn_v_b.weight", nh, dv, R),
                         dim=1),
                     leaf(b + "attn_kv_b.weight", nh * (dn + dv), R, fn=kv_b))),  # legacy files: kv_b unsplit
        Param(m + "o_proj.weight", leaf(a + "o_proj.weight", E, nh * dv), leaf(b + "attn_output.weight", E, nh * dv)),
    ]


def _mlp_table(cfg: KimiConfig, src: str, b: str, f: str) -> list[Param]:
    """Moonshot names dense layers mlp.*; transformers saves them as block_sparse_moe.*."""
    E, I = cfg.hidden_size, cfg.intermediate_size

    def named(name: str, *shape: int):
        return either(*(leaf(f"{src}{p}.{name}", *shape) for p in ("mlp", "block_sparse_moe")))
    return [Param(f + "gate_up.weight", cat(named("gate_proj.weight", I, E), named("up_proj.weight", I, E)),
                  cat(leaf(b + "ffn_gate.weight", I, E), leaf(b + "ffn_up.weight", I, E))),
            Param(f + "down.weight", named("down_proj.weight", E, I), leaf(b + "ffn_down.weight", E, I))]


def _moe_table(cfg: KimiConfig, src: str, b: str, f: str) -> list[Param]:
    """Published: block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down); transformers in memory:
    mlp.experts.gate_up_proj [n, 2I, E] (gate rows first) and down_proj."""
    E, n, I, S = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size

    def named(name: str, *shape: int, **kw):
        return either(*(leaf(f"{src}{p}.{name}", *shape, **kw) for p in ("block_sparse_moe", "mlp")))

    def experts(w: str, *shape: int):
        return [stack([leaf(f"{src}{p}.experts.{j}.{w}.weight", *shape) for j in range(n)])
                for p in ("block_sparse_moe", "mlp")]
    gate_up = [stack([cat(leaf(f"{src}{p}.experts.{j}.w1.weight", I, E), leaf(f"{src}{p}.experts.{j}.w3.weight", I, E))
                      for j in range(n)]) for p in ("block_sparse_moe", "mlp")]
    table = [
        Param(f + "router.weight", named("gate.weight", n, E), leaf(b + "ffn_gate_inp.weight", n, E)),
        Param(f + "expert_bias", named("gate.e_score_correction_bias", n), leaf(b + "exp_probs_b.bias", n)),
        Param(f + "experts.gate_up", either(*gate_up, named("experts.gate_up_proj", n, 2 * I, E)),
              either(cat(leaf(b + "ffn_gate_exps.weight", n, I, E), leaf(b + "ffn_up_exps.weight", n, I, E), dim=1),
                     leaf(b + "ffn_gate_up_exps.weight", n, 2 * I, E))),
        Param(f + "experts.down", either(*experts("w2", E, I), named("experts.down_proj", n, E, I)),
              leaf(b + "ffn_down_exps.weight", n, E, I)),
    ]
    if S:
        table += [Param(f + "shared.gate_up.weight", cat(named("shared_experts.gate_proj.weight", S, E),
                                                         named("shared_experts.up_proj.weight", S, E)),
                        cat(leaf(b + "ffn_gate_shexp.weight", S, E), leaf(b + "ffn_up_shexp.weight", S, E))),
                  Param(f + "shared.down.weight", named("shared_experts.down_proj.weight", E, S),
                        leaf(b + "ffn_down_shexp.weight", E, S))]
    return table
