"""Kimi Linear (kimi-linear / kimi_linear): Kimi Delta Attention layers interleaved with rope-less MLA.

KDA is the gated delta rule with a decay per key channel; MLA caches one compressed latent per token and
absorbs the key/value up-projections into the query and the output. Each layer is followed by a dense
SwiGLU MLP (the leading layers) or a sigmoid-routed MoE. `KimiModel.forward` advances a batch of sequences
held in `HybridState` slots. Everything a checkpoint format does differently is undone in
`_weights_from_hf` / `_weights_from_gguf`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.cache.state import HybridState, Snapshots
from deltaserve.models.config import KimiConfig
from deltaserve.models.layers import MLP, Embedding, Linear, RMSNorm, SigmoidMoE, cached_attention
from deltaserve.models.common import build, check_batch, fetch, fetch_rows, lm_logits, stack_rows
from deltaserve.models.qwen import conv_tape
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
        self.k_b = nn.Parameter(torch.empty(nh, self.dn, self.R))
        self.v_b = nn.Parameter(torch.empty(nh, cfg.v_head_dim, self.R))
        self.o_proj = Linear(nh * cfg.v_head_dim, E, bias=False)
        self.scale = (self.dn + self.dr) ** -0.5  # of the expanded heads, which the absorption leaves unchanged

    def forward(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """x [N, T, E]; cache [S, max_len, 1, R + dr] rows of [c | k_pe]; start [N] tokens already cached."""
        N, T, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.q_low_rank else self.q_proj(x)
        q_nope, q_pe = q.view(N, T, self.nh, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.R, self.dr], dim=-1)
        kv = torch.cat([self.kv_a_norm(latent), k_pe], dim=-1)[:, :, None]  # [N, T, 1, R + dr]
        k_b = self.k_b.to(q_nope.dtype)  # weights may be stored narrower than the activations
        q = torch.cat([torch.einsum("nthd,hdr->nthr", q_nope, k_b), q_pe], dim=-1)  # [N, T, nh, R + dr]
        # values are the first R channels of each cached row: a view, so the cache holds c only once
        o = cached_attention(q, kv, kv[..., :self.R], cache, cache[..., :self.R], slots, start, self.scale)
        o = torch.einsum("nthr,hvr->nthv", o, self.v_b.to(o.dtype))  # [N, T, nh, dv]
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


class KimiModel(nn.Module):
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.compute_dtype = torch.float32  # activations (and conv states); weights may be stored narrower
        self.cache_dtype: torch.dtype | None = None  # the KV cache's (None: compute_dtype); see load_model
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)

    @classmethod
    def from_checkpoint(cls, ckpt, dtype: torch.dtype = torch.float32, device="cpu",
                        weight_dtype: torch.dtype | None = None) -> KimiModel:
        """Build from an opened checkpoint: a GGUF file (has `.metadata`) or a transformers directory
        (has `.config`). Norms, A, dt_bias, the conv and the routers stay float32; every other weight is stored in
        `weight_dtype` (default: `dtype`, the dtype the activations are computed in)."""
        return build(cls, KimiConfig, _weights_from_gguf, _weights_from_hf, ckpt, dtype=dtype, device=device,
                     weight_dtype=weight_dtype,
                     keep_fp32=("norm.weight", ".A", ".dt_bias", "conv_weight", "router.weight", "expert_bias"))

    def new_state(self, n_slots: int, max_len: int) -> HybridState:
        """Per slot: KDA conv rows [q | k | v] and delta-rule states; MLA rows [c | k_pe] in `k`. `v` has
        width 0 because the values are the first kv_lora_rank channels of those rows."""
        cfg, p = self.config, self.embed.weight
        return HybridState.allocate(
            [t == "linear_attention" for t in cfg.layer_types], n_slots, max_len,
            conv=(cfg.conv_kernel - 1, 3 * cfg.kda_dim), ssm=(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim),
            k=(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), v=(1, 0), dtype=self.compute_dtype,
            kv_dtype=self.cache_dtype, device=p.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: HybridState, slots, logits: str = "last",
                snapshots: int = 0) -> torch.Tensor:
        """Continue N sequences by T tokens each. input_ids [N, T]; slots [N] rows of `state`.

        Writes the new recurrent state and latent cache entries in place and advances state.lengths[slots]
        by T. Returns float32 logits [N, vocab] for the last token ("last") or [N, T, vocab] ("all").
        snapshots=K > 0 also keeps in state.snapshots the recurrent states after each of the last K
        tokens, so that state.rollback can return any slot to one of those positions.
        """
        input_ids, slots = check_batch(self, input_ids, state, slots, logits)
        T = input_ids.shape[1]
        start = state.lengths[slots]  # [N] tokens already in each slot
        snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * len(self.layers),
                          [None] * len(self.layers)) if snapshots else None
        h = self.embed(input_ids, self.compute_dtype)
        for i, layer in enumerate(self.layers):
            x = layer.input_norm(h)
            if layer.recurrent and snaps is not None:
                x, snaps.conv[i], snaps.ssm[i] = layer.mixer(x, state.conv[i], state.ssm[i], slots,
                                                             snapshots=snapshots)
            elif layer.recurrent:  # the ops read and write the cache rows of `slots` in place
                x = layer.mixer(x, state.conv[i], state.ssm[i], slots)
            else:
                x = layer.mixer(x, state.k[i], slots, start)
            h = h + x
            h = h + layer.ffn(layer.post_norm(h))
        state.lengths[slots] = start + T
        if snaps is not None:
            state.snapshots = snaps
        h = self.norm(h[:, -1] if logits == "last" else h)
        return lm_logits(self, h)


# ---------------------------------------------------------------------------- checkpoint formats

def _weights_from_hf(ckpt, cfg: KimiConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Moonshot's names (q_conv1d, f_a_proj on self_attn, block_sparse_moe.experts.{j}.w1/w2/w3) or the ones
    transformers holds in memory (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj). Norms are plain
    multipliers; A_log is [1, 1, H, 1]; kv_b_proj holds per head [k_nope | v] rows."""
    E, H, D, W = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    nh, dn, dr, dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def w(name, *shape):
        return fetch(ckpt, name, *shape)

    yield "embed.weight", w("model.embed_tokens.weight", cfg.vocab_size, E)
    yield "norm.weight", w("model.norm.weight", E)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", w("lm_head.weight", cfg.vocab_size, E)
    for i, kind in enumerate(cfg.layer_types):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        yield dst + "input_norm.weight", w(src + "input_layernorm.weight", E)
        yield dst + "post_norm.weight", w(src + "post_attention_layernorm.weight", E)
        a, m = src + "self_attn.", dst + "mixer."
        if kind == "linear_attention":
            fg = a + "forget_gate." if ckpt.has(a + "forget_gate.f_a_proj.weight") else a
            yield m + "in_proj.weight", torch.cat([
                w(a + "q_proj.weight", H * D, E), w(a + "k_proj.weight", H * D, E), w(a + "v_proj.weight", H * D, E),
                w(fg + "f_a_proj.weight", D, E), w(a + "g_a_proj.weight", D, E), w(a + "b_proj.weight", H, E)])
            if ckpt.has(a + "conv1d.weight"):
                yield m + "conv_weight", w(a + "conv1d.weight", 3 * H * D, W)
            else:
                yield m + "conv_weight", torch.cat([w(a + f"{x}_conv1d.weight", H * D, W) for x in "qkv"])
            yield m + "f_b.weight", w(fg + "f_b_proj.weight", H * D, D)
            yield m + "g_b.weight", w(a + "g_b_proj.weight", H * D, D)
            yield m + "dt_bias", w(fg + "dt_bias", H * D)
            yield m + "A", -torch.exp(w(fg + "A_log", H))
            yield m + "norm.weight", w(a + "o_norm.weight", D)
            yield m + "out_proj.weight", w(a + "o_proj.weight", E, H * D)
        else:
            if cfg.q_lora_rank:
                yield m + "q_a.weight", w(a + "q_a_proj.weight", cfg.q_lora_rank, E)
                yield m + "q_a_norm.weight", w(a + "q_a_layernorm.weight", cfg.q_lora_rank)
                yield m + "q_b.weight", w(a + "q_b_proj.weight", nh * (dn + dr), cfg.q_lora_rank)
            else:
                yield m + "q_proj.weight", w(a + "q_proj.weight", nh * (dn + dr), E)
            yield m + "kv_a.weight", w(a + "kv_a_proj_with_mqa.weight", R + dr, E)
            yield m + "kv_a_norm.weight", w(a + "kv_a_layernorm.weight", R)
            k_b, v_b = w(a + "kv_b_proj.weight", nh * (dn + dv), R).view(nh, dn + dv, R).split([dn, dv], dim=1)
            yield m + "k_b", k_b
            yield m + "v_b", v_b
            yield m + "o_proj.weight", w(a + "o_proj.weight", E, nh * dv)
        p, f = _ffn_prefix(ckpt, src), dst + "ffn."
        if cfg.ffn_types[i] == "dense":
            I = cfg.intermediate_size
            yield f + "gate_up.weight", torch.cat([w(p + "gate_proj.weight", I, E), w(p + "up_proj.weight", I, E)])
            yield f + "down.weight", w(p + "down_proj.weight", E, I)
            continue
        n, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        yield f + "router.weight", w(p + "gate.weight", n, E)
        yield f + "expert_bias", w(p + "gate.e_score_correction_bias", n)
        if ckpt.has(p + "experts.gate_up_proj"):  # transformers' fused in-memory layout, gate rows first
            yield f + "experts.gate_up", w(p + "experts.gate_up_proj", n, 2 * I, E)
            yield f + "experts.down", w(p + "experts.down_proj", n, E, I)
        else:  # w1 = gate, w3 = up, w2 = down
            yield f + "experts.gate_up", torch.stack([torch.cat([w(p + f"experts.{j}.w1.weight", I, E),
                                                                 w(p + f"experts.{j}.w3.weight", I, E)])
                                                      for j in range(n)])
            yield f + "experts.down", torch.stack([w(p + f"experts.{j}.w2.weight", E, I) for j in range(n)])
        if S:
            sh = p + "shared_experts."
            yield f + "shared.gate_up.weight", torch.cat([w(sh + "gate_proj.weight", S, E),
                                                          w(sh + "up_proj.weight", S, E)])
            yield f + "shared.down.weight", w(sh + "down_proj.weight", E, S)


def _ffn_prefix(ckpt, src: str) -> str:
    """Moonshot names dense layers mlp.* and MoE layers block_sparse_moe.*; transformers saves both as the
    latter and holds both as mlp.* in memory."""
    moe = src + "block_sparse_moe."
    return moe if any(ckpt.has(moe + n) for n in ("gate.weight", "gate_proj.weight")) else src + "mlp."


def _weights_from_gguf(ckpt, cfg: KimiConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """llama.cpp layout: ssm_a = -exp(A_log) as {1, H, 1, 1}, convs {W, 1, H*D, 1}, the post-attention norm
    as ffn_norm; attn_k_b {dn, R, nh} (k_b transposed) and attn_v_b {R, dv, nh}, or the legacy attn_kv_b."""
    E, H, D, W = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    nh, dn, dr, dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def w(name, *shape):
        return fetch(ckpt, name, *shape)

    def rows(name, *shape):  # a large 2-D weight: read a block of rows at a time when it is stored
        return fetch_rows(ckpt, name, *shape)

    yield "embed.weight", fetch_rows(ckpt, "token_embd.weight", cfg.vocab_size, E)
    yield "norm.weight", w("output_norm.weight", E)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", fetch_rows(ckpt, "output.weight", cfg.vocab_size, E)
    for i, kind in enumerate(cfg.layer_types):
        b, dst = f"blk.{i}.", f"layers.{i}."
        m, f = dst + "mixer.", dst + "ffn."
        yield dst + "input_norm.weight", w(b + "attn_norm.weight", E)
        yield dst + "post_norm.weight", w(b + "ffn_norm.weight", E)
        if kind == "linear_attention":
            yield m + "in_proj.weight", stack_rows([
                rows(b + "attn_q.weight", H * D, E), rows(b + "attn_k.weight", H * D, E),
                rows(b + "attn_v.weight", H * D, E), w(b + "ssm_f_a.weight", D, E), w(b + "ssm_g_a.weight", D, E),
                w(b + "ssm_beta.weight", H, E)])
            yield m + "conv_weight", torch.cat([w(b + f"ssm_conv1d_{x}.weight", H * D, W) for x in "qkv"])
            yield m + "f_b.weight", w(b + "ssm_f_b.weight", H * D, D)
            yield m + "g_b.weight", w(b + "ssm_g_b.weight", H * D, D)
            yield m + "dt_bias", w(b + "ssm_dt.bias", H * D)
            yield m + "A", w(b + "ssm_a", H)
            yield m + "norm.weight", w(b + "ssm_norm.weight", D)
            yield m + "out_proj.weight", rows(b + "attn_output.weight", E, H * D)
        else:
            if cfg.q_lora_rank:
                yield m + "q_a.weight", w(b + "attn_q_a.weight", cfg.q_lora_rank, E)
                yield m + "q_a_norm.weight", w(b + "attn_q_a_norm.weight", cfg.q_lora_rank)
                yield m + "q_b.weight", w(b + "attn_q_b.weight", nh * (dn + dr), cfg.q_lora_rank)
            else:
                yield m + "q_proj.weight", w(b + "attn_q.weight", nh * (dn + dr), E)
            yield m + "kv_a.weight", w(b + "attn_kv_a_mqa.weight", R + dr, E)
            yield m + "kv_a_norm.weight", w(b + "attn_kv_a_norm.weight", R)
            if ckpt.has(b + "attn_kv_b.weight"):  # legacy files: the un-split kv_b_proj
                k_b, v_b = w(b + "attn_kv_b.weight", nh * (dn + dv), R).view(nh, dn + dv, R).split([dn, dv], dim=1)
            else:
                k_b = w(b + "attn_k_b.weight", nh, R, dn).transpose(1, 2)
                v_b = w(b + "attn_v_b.weight", nh, dv, R)
            yield m + "k_b", k_b.contiguous()
            yield m + "v_b", v_b
            yield m + "o_proj.weight", rows(b + "attn_output.weight", E, nh * dv)
        if cfg.ffn_types[i] == "dense":
            I = cfg.intermediate_size
            yield f + "gate_up.weight", stack_rows([rows(b + "ffn_gate.weight", I, E), rows(b + "ffn_up.weight", I, E)])
            yield f + "down.weight", rows(b + "ffn_down.weight", E, I)
            continue
        n, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        yield f + "router.weight", w(b + "ffn_gate_inp.weight", n, E)
        yield f + "expert_bias", w(b + "exp_probs_b.bias", n)
        if ckpt.has(b + "ffn_gate_up_exps.weight"):  # gate rows first, then up
            yield f + "experts.gate_up", w(b + "ffn_gate_up_exps.weight", n, 2 * I, E)
        else:
            yield f + "experts.gate_up", torch.cat([w(b + "ffn_gate_exps.weight", n, I, E),
                                                    w(b + "ffn_up_exps.weight", n, I, E)], dim=1)
        yield f + "experts.down", w(b + "ffn_down_exps.weight", n, E, I)
        if S:
            yield f + "shared.gate_up.weight", torch.cat([w(b + "ffn_gate_shexp.weight", S, E),
                                                          w(b + "ffn_up_shexp.weight", S, E)])
            yield f + "shared.down.weight", w(b + "ffn_down_shexp.weight", E, S)
