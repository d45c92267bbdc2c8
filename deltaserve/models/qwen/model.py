"""Qwen hybrid models: Qwen3.5 (qwen35), Qwen3.5-MoE (qwen35moe) and Qwen3-Next (qwen3next).

Three Gated DeltaNet layers, then one gated full-attention layer, repeated; each followed by a SwiGLU
MLP or a routed MoE. `QwenModel.forward` (models/base.py) advances a batch of sequences held in
`HybridState` slots, or without a state runs whole sequences differentiably (training).
Everything a checkpoint format does differently is in `QwenModel.weight_table`, read forwards to load and
backwards to write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.models.base import HybridModel, conv_tape
from deltaserve.models.layers import MLP, GatedAttention, Linear, RMSNorm, RotaryEmbedding, SparseMoE
from deltaserve.models.mtp import MTPHead
from deltaserve.models.qwen import plan
from deltaserve.models.qwen.config import QwenConfig
from deltaserve.models.weights import (IDENTITY, NEG_EXP, PLUS_ONE, Param, cat, either, leaf, per_head, reshape,
                                       stack, tiled_heads)
from deltaserve.ops import causal_conv1d, fused, gated_delta_rule


class GatedDeltaNet(nn.Module):
    """Short causal conv over [q | k | v], then the gated delta rule with per-head decay and step size.

    beta = sigmoid(b), g = A * softplus(a + dt_bias) with A = -exp(A_log);
    output = out_proj(RMSNorm(o) * silu(z)) per value head. Value head j reads key head j // (HV / H).
    """

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.H, self.HV, self.K, self.V = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        self.conv_dim = cfg.conv_dim
        # rows: q (H*K) | k (H*K) | v (HV*V) | z (HV*V) | b (HV) | a (HV), value heads in grouped order
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.HV * self.V + 2 * self.HV, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.HV))
        self.A = nn.Parameter(torch.empty(self.HV))
        self.norm = RMSNorm(self.V, cfg.rms_norm_eps)
        self.out_proj = Linear(self.HV * self.V, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                slots: torch.Tensor | None = None, snapshots: int = 0):
        """x [N, T, E]; sequence n continues cache row slots[n] (row n when None) of conv_state [S, W-1, conv_dim]
        and ssm_state [S, HV, K, V], both updated in place. Without states each row starts from zero and
        nothing is kept (training: the ops then take their differentiable path).
        snapshots=K > 0: returns (y, conv_tape(...) [N, W-1+T, conv_dim], ssm [N, K, HV, K, V] the states after
        each of the last K tokens, newest first) instead of y alone."""
        N, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        cached = conv_state is not None
        proj = self.in_proj(x)
        if slots is not None and _core_applies(proj, conv_state, ssm_state, self.conv_weight):
            # inference on the caches: conv, gates, delta rule and gated norm in one C++ call (keeping what
            # rollback reads, with snapshots)
            tape = torch.empty(N, conv_state.shape[1] + T, self.conv_dim) if snapshots else fused.EMPTY_F32
            kept = torch.empty(N, snapshots, HV, K, V) if snapshots else fused.EMPTY_F32
            o = fused.extension().gdn_core_kept(proj, self.conv_weight, conv_state, slots, self.A, self.dt_bias,
                                                ssm_state, self.norm.weight, self.norm.eps, H, tape, kept)
            del proj  # 17 MB at 512 tokens of a 0.8B model, no longer held through the out projection
            y = self.out_proj(o)
            return (y, tape, kept) if snapshots else y
        qkv, z, b, a = proj.split([self.conv_dim, HV * V, HV, HV], dim=-1)
        tape = conv_tape(conv_state, slots, qkv) if snapshots else None
        qkv, _ = causal_conv1d(qkv, self.conv_weight, conv_state=conv_state, state_indices=slots, inplace=cached,
                               activation="silu", out=qkv if cached else None)  # inference: over its input
        q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
        beta = torch.sigmoid(b.float())  # [N, T, HV]
        g = self.A * F.softplus(a.float() + self.dt_bias)  # [N, T, HV] log-decay <= 0
        o, _, *ssm_snaps = gated_delta_rule(q.view(N, T, H, K), k.view(N, T, H, K), v.view(N, T, HV, V), g, beta,
                                            initial_state=ssm_state, state_indices=slots, inplace=cached,
                                            snapshots=snapshots, use_qk_l2norm=True)
        o = self.norm(o, gate=z.view(N, T, HV, V), inplace=True)  # [N, T, HV, V]
        y = self.out_proj(o.reshape(N, T, HV * V))
        return (y, tape, ssm_snaps[0]) if snapshots else y


def _core_applies(proj, conv_state, ssm_state, conv_weight) -> bool:
    """Whether gdn_core computes this call: inference on float32 contiguous CPU caches and projection."""
    return (conv_state is not None and not torch.is_grad_enabled() and proj.is_cpu and fused.available()
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (proj, conv_state, ssm_state, conv_weight)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig, kind: str, ffn: str):
        """kind: "linear_attention" | "full_attention"; ffn: "dense" | "moe"."""
        super().__init__()
        self.recurrent = kind == "linear_attention"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.recurrent:
            self.mixer = GatedDeltaNet(cfg)
        else:
            self.mixer = GatedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.rms_norm_eps)
        if ffn == "moe":
            self.ffn = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
        else:
            self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size)


class QwenModel(HybridModel):
    config_class = QwenConfig
    gguf_archs = ("qwen35", "qwen35moe", "qwen3next")
    hf_model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    supports_training = True

    def __init__(self, config: QwenConfig, compute_dtype: torch.dtype = torch.float32,
                 cache_dtype: torch.dtype | None = None, mtp: bool = True):
        super().__init__(config, compute_dtype, cache_dtype, mtp)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def make_layer(self, config: QwenConfig, index: int) -> nn.Module:
        return DecoderLayer(config, config.layer_types[index], config.ffn_types[index])

    def make_mtp(self, config: QwenConfig) -> MTPHead | None:
        if config.mtp_layers != 1:  # as llama.cpp: one MTP block or none
            return None
        return MTPHead(config.hidden_size, config.rms_norm_eps, DecoderLayer(config, "full_attention", config.mtp_ffn))

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        return dict(conv=(cfg.conv_kernel - 1, cfg.conv_dim), ssm=(cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim),
                    k=(cfg.num_kv_heads, cfg.head_dim), v=(cfg.num_kv_heads, cfg.head_dim))

    def rope(self, positions: torch.Tensor):
        return self.rotary(positions)

    def attend(self, layer, x, rope, k_cache, v_cache, slots, start):
        cos, sin = rope
        return layer.mixer(x, cos, sin, k_cache, v_cache, slots, start)

    def decode_step(self, h, rope, state, slots, start, layers, snaps=None):
        return plan.step(self, h, rope, state, slots, start, layers, snaps)

    def mtp_follow(self, ids, before, rope, k_cache, v_cache, slots, start):
        return plan.mtp_follow(self, ids, before, rope, k_cache, v_cache, slots, start)

    def mtp_draft(self, state, slots, ids, hidden, ks):
        return plan.mtp_draft(self, state, slots, ids, hidden, ks)

    def mtp_greedy_step(self, state, slots, ids, ks):
        return plan.mtp_greedy_step(self, state, slots, ids, ks)

    # -- the checkpoint contract --------------------------------------------------------------------

    @classmethod
    def weight_table(cls, cfg: QwenConfig, hf_root: str = "model.") -> list[Param]:
        """transformers' layout: zero-centred norms (multiplier 1 + w) except the GDN output norm, A_log,
        value heads grouped, q_proj rows per head [query | gate]; Qwen3-Next interleaves q/k/v/z and b/a
        per key head and publishes one module per expert. llama.cpp's (convert_hf_to_gguf.py): norms stored
        + 1, ssm_a = -exp(A_log), experts stacked, fused projections split into attn_qkv / attn_gate /
        ssm_beta / ssm_alpha (Qwen3-Next keeps ssm_ba per key head), and Qwen3.5 value heads tiled."""
        E, V = cfg.hidden_size, cfg.vocab_size
        table = [Param("embed.weight", leaf(hf_root + "embed_tokens.weight", V, E), leaf("token_embd.weight", V, E))]
        for i, kind in enumerate(cfg.layer_types):
            table += _layer_table(cfg, kind, cfg.ffn_types[i], f"{hf_root}layers.{i}.", f"blk.{i}.", f"layers.{i}.")
        table.append(Param("norm.weight", leaf(hf_root + "norm.weight", E, fn=PLUS_ONE), leaf("output_norm.weight", E)))
        if not cfg.tie_word_embeddings:
            table.append(Param("lm_head.weight", leaf("lm_head.weight", V, E), leaf("output.weight", V, E)))
        return table + (_mtp_table(cfg) if cfg.mtp_layers == 1 else [])


def _layer_table(cfg: QwenConfig, kind: str, ffn: str, src: str, b: str, dst: str) -> list[Param]:
    """One decoder layer: transformers' names under src, llama.cpp's block b, ours under dst."""
    E = cfg.hidden_size
    table = [Param(dst + "input_norm.weight", leaf(src + "input_layernorm.weight", E, fn=PLUS_ONE),
                   leaf(b + "attn_norm.weight", E)),
             Param(dst + "post_norm.weight", leaf(src + "post_attention_layernorm.weight", E, fn=PLUS_ONE),
                   leaf(b + "post_attention_norm.weight", E))]
    if kind == "linear_attention":
        table += _delta_net_table(cfg, src + "linear_attn.", b, dst + "mixer.")
    else:
        table += _attention_table(cfg, src + "self_attn.", b, dst + "mixer.")
    return table + (_mlp_table if ffn == "dense" else _moe_table)(cfg, src + "mlp.", b, dst + "ffn.")


def _mtp_table(cfg: QwenConfig) -> list[Param]:
    """The MTP layer: transformers' `mtp.*` (top level, also beside a nested language model); llama.cpp's
    converter appends it as block n after the trunk's n, renaming fc -> nextn.eh_proj, pre_fc_norm_embedding
    -> nextn.enorm, pre_fc_norm_hidden -> nextn.hnorm, norm -> nextn.shared_head_norm (norms + 1 like the
    trunk's), and the decoder layer's tensors as a trunk block's. eh_proj's columns are [embedding | hidden]."""
    E, b = cfg.hidden_size, f"blk.{cfg.num_layers}."
    return [
        Param("mtp.fc.weight", leaf("mtp.fc.weight", E, 2 * E), leaf(b + "nextn.eh_proj.weight", E, 2 * E)),
        Param("mtp.enorm.weight", leaf("mtp.pre_fc_norm_embedding.weight", E, fn=PLUS_ONE),
              leaf(b + "nextn.enorm.weight", E)),
        Param("mtp.hnorm.weight", leaf("mtp.pre_fc_norm_hidden.weight", E, fn=PLUS_ONE),
              leaf(b + "nextn.hnorm.weight", E)),
        *_layer_table(cfg, "full_attention", cfg.mtp_ffn, "mtp.layers.0.", b, "mtp.layer."),
        Param("mtp.norm.weight", leaf("mtp.norm.weight", E, fn=PLUS_ONE), leaf(b + "nextn.shared_head_norm.weight", E)),
    ]


def _delta_net_table(cfg: QwenConfig, a: str, b: str, m: str) -> list[Param]:
    E, H, HV, K, V, W, C = (cfg.hidden_size, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim,
                            cfg.linear_v_dim, cfg.conv_kernel, cfg.conv_dim)
    r, qk = HV // H, 2 * H * K
    if cfg.arch == "qwen3next":  # value heads grouped in both formats; b / a per key head
        heads = head = IDENTITY
        ba = leaf(b + "ssm_ba.weight", 2 * HV, E, fn=per_head(H, [r, r]))
        hf_in = cat(leaf(a + "in_proj_qkvz.weight", H * (2 * K + 2 * r * V), E, fn=per_head(H, [K, K, r * V, r * V])),
                    leaf(a + "in_proj_ba.weight", 2 * HV, E, fn=per_head(H, [r, r])))
        gguf_in = either(cat(leaf(b + "attn_qkv.weight", C, E), leaf(b + "attn_gate.weight", HV * V, E), ba),
                         cat(leaf(b + "ssm_in.weight", H * (2 * K + 2 * r * V), E,  # old files: qkvz as published
                                  fn=per_head(H, [K, K, r * V, r * V])), ba))
    else:  # llama.cpp broadcasts key heads over tiled value heads
        heads, head = tiled_heads(0, H, r, V), tiled_heads(0, H, r, 1)
        hf_in = cat(leaf(a + "in_proj_qkv.weight", C, E), leaf(a + "in_proj_z.weight", HV * V, E),
                    leaf(a + "in_proj_b.weight", HV, E), leaf(a + "in_proj_a.weight", HV, E))
        gguf_in = cat(leaf(b + "attn_qkv.weight", C, E, fn=tiled_heads(0, H, r, V, start=qk)),
                      leaf(b + "attn_gate.weight", HV * V, E, fn=heads), leaf(b + "ssm_beta.weight", HV, E, fn=head),
                      leaf(b + "ssm_alpha.weight", HV, E, fn=head))
    conv = tiled_heads(0, H, r, V, start=qk) if heads is not IDENTITY else IDENTITY
    return [
        Param(m + "in_proj.weight", hf_in, gguf_in),  # rows q | k | v | z | b | a, value heads grouped
        Param(m + "conv_weight", leaf(a + "conv1d.weight", C, 1, W, fn=reshape((C, 1, W), (C, W))),
              leaf(b + "ssm_conv1d.weight", C, W, fn=conv)),
        Param(m + "dt_bias", leaf(a + "dt_bias", HV), leaf(b + "ssm_dt.bias", HV, fn=head)),
        Param(m + "A", leaf(a + "A_log", HV, fn=NEG_EXP), leaf(b + "ssm_a", HV, fn=head)),
        Param(m + "norm.weight", leaf(a + "norm.weight", V), leaf(b + "ssm_norm.weight", V)),  # a plain multiplier
        Param(m + "out_proj.weight", leaf(a + "out_proj.weight", E, HV * V),
              leaf(b + "ssm_out.weight", E, HV * V, fn=tiled_heads(1, H, r, V) if heads is not IDENTITY else IDENTITY)),
    ]


def _attention_table(cfg: QwenConfig, s: str, b: str, m: str) -> list[Param]:
    E, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_gate = per_head(nh, [hd, hd])  # per head [query | gate] -> all queries | all gates
    kv = [(nkv * hd, E)] * 2
    return [
        Param(m + "qkv_proj.weight",
              cat(leaf(s + "q_proj.weight", 2 * nh * hd, E, fn=q_gate), leaf(s + "k_proj.weight", *kv[0]),
                  leaf(s + "v_proj.weight", *kv[1])),
              either(cat(leaf(b + "attn_q.weight", 2 * nh * hd, E, fn=q_gate), leaf(b + "attn_k.weight", *kv[0]),
                         leaf(b + "attn_v.weight", *kv[1])),
                     leaf(b + "attn_qkv.weight", (2 * nh + 2 * nkv) * hd, E, fn=q_gate))),
        Param(m + "q_norm.weight", leaf(s + "q_norm.weight", hd, fn=PLUS_ONE), leaf(b + "attn_q_norm.weight", hd)),
        Param(m + "k_norm.weight", leaf(s + "k_norm.weight", hd, fn=PLUS_ONE), leaf(b + "attn_k_norm.weight", hd)),
        Param(m + "o_proj.weight", leaf(s + "o_proj.weight", E, nh * hd), leaf(b + "attn_output.weight", E, nh * hd)),
    ]


def _mlp_table(cfg: QwenConfig, p: str, b: str, f: str, width: int | None = None, hf: str = "",
               gguf: str = "") -> list[Param]:
    """A SwiGLU MLP: gate_up rows [gate | up]. hf / gguf: the names' infixes of a shared expert."""
    E, I = cfg.hidden_size, width or cfg.intermediate_size
    return [Param(f + "gate_up.weight", cat(leaf(f"{p}{hf}gate_proj.weight", I, E), leaf(f"{p}{hf}up_proj.weight", I, E)),
                  cat(leaf(f"{b}ffn_gate{gguf}.weight", I, E), leaf(f"{b}ffn_up{gguf}.weight", I, E))),
            Param(f + "down.weight", leaf(f"{p}{hf}down_proj.weight", E, I), leaf(f"{b}ffn_down{gguf}.weight", E, I))]


def _moe_table(cfg: QwenConfig, p: str, b: str, f: str) -> list[Param]:
    E, n, I, S = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    x = p + "experts."
    per_expert = (stack([cat(leaf(f"{x}{e}.gate_proj.weight", I, E), leaf(f"{x}{e}.up_proj.weight", I, E))
                         for e in range(n)]),
                  stack([leaf(f"{x}{e}.down_proj.weight", E, I) for e in range(n)]))
    fused = leaf(x + "gate_up_proj", n, 2 * I, E), leaf(x + "down_proj", n, E, I)  # transformers' own layout
    first, second = (per_expert, fused) if cfg.arch == "qwen3next" else (fused, per_expert)  # as published
    table = [
        Param(f + "router.weight", leaf(p + "gate.weight", n, E), leaf(b + "ffn_gate_inp.weight", n, E)),
        Param(f + "experts.gate_up", either(first[0], second[0]),
              either(cat(leaf(b + "ffn_gate_exps.weight", n, I, E), leaf(b + "ffn_up_exps.weight", n, I, E), dim=1),
                     leaf(b + "ffn_gate_up_exps.weight", n, 2 * I, E))),
        Param(f + "experts.down", either(first[1], second[1]), leaf(b + "ffn_down_exps.weight", n, E, I)),
    ]
    if S:
        table += _mlp_table(cfg, p, b, f + "shared.", S, hf="shared_expert.", gguf="_shexp")
        table.append(Param(f + "shared_gate.weight", leaf(p + "shared_expert_gate.weight", 1, E),
                           leaf(b + "ffn_gate_inp_shexp.weight", 1, E)))
    return table
