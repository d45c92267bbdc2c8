"""Qwen hybrid models: Qwen3.5 (qwen35), Qwen3.5-MoE (qwen35moe) and Qwen3-Next (qwen3next).

Three Gated DeltaNet layers, then one gated full-attention layer, repeated; each followed by a SwiGLU
MLP or a routed MoE. `QwenModel.forward` advances a batch of sequences held in `HybridState` slots, or
without a state runs whole sequences differentiably (training).
Everything a checkpoint format does differently is undone in `_weights_from_hf` / `_weights_from_gguf`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.cache.state import HybridState, Snapshots
from deltaserve.models.common import build, check_batch, check_ids, dense, fetch, fetch_rows, lm_logits, stack_rows
from deltaserve.models.config import QwenConfig
from deltaserve.models.layers import MLP, Embedding, GatedAttention, Linear, RMSNorm, RotaryEmbedding, SparseMoE
from deltaserve.ops import causal_conv1d, gated_delta_rule


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
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, HV * V, HV, HV], dim=-1)
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


def conv_tape(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[conv state before x | x], [N, W-1+T, C]: the conv state after token t of x is rows t+1 .. t+W-1
    (HybridState.rollback reads them), so snapshots of the short conv cost one concatenation."""
    return torch.cat([conv_state[slots].to(x.dtype), x], dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig, index: int):
        super().__init__()
        self.recurrent = cfg.layer_types[index] == "linear_attention"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.recurrent:
            self.mixer = GatedDeltaNet(cfg)
        else:
            self.mixer = GatedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.rms_norm_eps)
        if cfg.ffn_types[index] == "moe":
            self.ffn = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
        else:
            self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size)


class QwenModel(nn.Module):
    def __init__(self, config: QwenConfig):
        super().__init__()
        self.config = config
        self.compute_dtype = torch.float32  # activations (and conv states); weights may be stored narrower
        self.cache_dtype: torch.dtype | None = None  # the KV cache's (None: compute_dtype); see load_model
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    @classmethod
    def from_checkpoint(cls, ckpt, dtype: torch.dtype = torch.float32, device="cpu",
                        weight_dtype: torch.dtype | None = None) -> QwenModel:
        """Build from an opened checkpoint: a GGUF file (has `.metadata`) or a transformers directory
        (has `.config`). Norms, A, dt_bias and the conv stay float32; every other weight is stored in
        `weight_dtype` (default: `dtype`, the dtype the activations are computed in)."""
        return build(cls, QwenConfig, _weights_from_gguf, _weights_from_hf, ckpt, dtype=dtype, device=device,
                     weight_dtype=weight_dtype, keep_fp32=("norm.weight", ".A", ".dt_bias", "conv_weight"))

    def new_state(self, n_slots: int, max_len: int) -> HybridState:
        cfg, p = self.config, self.embed.weight
        return HybridState.allocate(
            [t == "linear_attention" for t in cfg.layer_types], n_slots, max_len,
            conv=(cfg.conv_kernel - 1, cfg.conv_dim), ssm=(cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim),
            k=(cfg.num_kv_heads, cfg.head_dim), v=(cfg.num_kv_heads, cfg.head_dim), dtype=self.compute_dtype,
            kv_dtype=self.cache_dtype, device=p.device)

    def forward(self, input_ids: torch.Tensor, state: HybridState | None = None, slots=None,
                logits: str = "last", snapshots: int = 0) -> torch.Tensor:
        """Continue N sequences by T tokens each. input_ids [N, T]; slots [N] rows of `state`.

        Writes the new recurrent state and KV entries in place and advances state.lengths[slots] by T.
        Returns float32 logits [N, vocab] for the last token ("last") or [N, T, vocab] ("all").
        snapshots=K > 0 also keeps in state.snapshots the recurrent states after each of the last K
        tokens, so that state.rollback can return any slot to one of those positions.
        Without `state` (training): each row is a whole sequence from an empty state, nothing is kept,
        gradients flow, and the logits of every position come back, [N, T, vocab].
        """
        if state is None:
            input_ids = check_ids(input_ids, self.config.vocab_size).to(self.embed.weight.device)
            N, T = input_ids.shape
            positions = torch.arange(T, device=input_ids.device).expand(N, T)
            return self._trunk(input_ids, positions, None, None, None, "all")
        with torch.inference_mode():
            input_ids, slots = check_batch(self, input_ids, state, slots, logits)
            start = state.lengths[slots]  # [N] tokens already in each slot
            T = input_ids.shape[1]
            snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * len(self.layers),
                              [None] * len(self.layers)) if snapshots else None
            out = self._trunk(input_ids, start[:, None] + torch.arange(T, device=start.device),
                              state, slots, start, logits, snaps)
            state.lengths[slots] = start + T
            if snaps is not None:
                state.snapshots = snaps
            return out

    def _trunk(self, input_ids, positions, state: HybridState | None, slots, start, logits: str,
               snaps: Snapshots | None = None) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        h = self.embed(input_ids, self.compute_dtype)
        for i, layer in enumerate(self.layers):
            x = layer.input_norm(h)
            if layer.recurrent and snaps is not None:
                x, snaps.conv[i], snaps.ssm[i] = layer.mixer(x, state.conv[i], state.ssm[i], slots,
                                                             snapshots=snaps.depth)
            elif layer.recurrent:  # the ops read and write the cache rows of `slots` in place
                conv, ssm = (None, None) if state is None else (state.conv[i], state.ssm[i])
                x = layer.mixer(x, conv, ssm, slots)
            else:
                k_cache, v_cache = (None, None) if state is None else (state.k[i], state.v[i])
                x = layer.mixer(x, cos, sin, k_cache, v_cache, slots, start)
            h = h + x
            h = h + layer.ffn(layer.post_norm(h))
        h = self.norm(h[:, -1] if logits == "last" else h)
        return lm_logits(self, h)

# ---------------------------------------------------------------------------- checkpoint formats


def _split_per_key_head(t: torch.Tensor, H: int, sizes: list[int]) -> list[torch.Tensor]:
    """Rows laid out per key head as [part0, part1, ...] -> each part with all key heads' rows together."""
    return [p.reshape(H * s, -1) for p, s in zip(t.view(H, sum(sizes), -1).split(sizes, dim=1), sizes)]


def _tiled_to_grouped(t: torch.Tensor, dim: int, H: int, r: int, head: int) -> torch.Tensor:
    """Reorder value heads along `dim` from tiled (head j reads key head j % H) to grouped (j // r)."""
    return t.unflatten(dim, (r, H, head)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def _attention_rows(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, hd: int) -> torch.Tensor:
    """q_proj rows are per head [query | gate]; we keep [all queries | all gates | keys | values]."""
    q, gate = q_gate.view(nh, 2, hd, -1).unbind(1)
    return torch.cat([q.reshape(nh * hd, -1), gate.reshape(nh * hd, -1), k, v])


def _weights_from_hf(ckpt, cfg: QwenConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers layout: zero-centred norms (multiplier 1 + w) except the GDN output norm, A_log,
    grouped value heads; Qwen3-Next interleaves q/k/v/z and b/a per key head."""
    E, H, HV, K, V, W = (cfg.hidden_size, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim,
                         cfg.linear_v_dim, cfg.conv_kernel)
    r, nh, nkv, hd = HV // H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = "model.language_model." if ckpt.has("model.language_model.embed_tokens.weight") else "model."

    def w(name, *shape):
        return fetch(ckpt, name, *shape)

    def norm(name, dim):
        return w(name, dim) + 1.0

    yield "embed.weight", w(p + "embed_tokens.weight", cfg.vocab_size, E)
    yield "norm.weight", norm(p + "norm.weight", E)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", w("lm_head.weight", cfg.vocab_size, E)
    for i, kind in enumerate(cfg.layer_types):  # mtp.* and layers past the trunk are never read
        src, dst = f"{p}layers.{i}.", f"layers.{i}."
        yield dst + "input_norm.weight", norm(src + "input_layernorm.weight", E)
        yield dst + "post_norm.weight", norm(src + "post_attention_layernorm.weight", E)
        if kind == "linear_attention":
            a = src + "linear_attn."
            if cfg.arch == "qwen3next":
                q, k, v, z = _split_per_key_head(w(a + "in_proj_qkvz.weight", H * (2 * K + 2 * r * V), E),
                                                 H, [K, K, r * V, r * V])
                b, alpha = _split_per_key_head(w(a + "in_proj_ba.weight", 2 * HV, E), H, [r, r])
                rows = [q, k, v, z, b, alpha]
            else:
                rows = [w(a + "in_proj_qkv.weight", cfg.conv_dim, E), w(a + "in_proj_z.weight", HV * V, E),
                        w(a + "in_proj_b.weight", HV, E), w(a + "in_proj_a.weight", HV, E)]
            yield dst + "mixer.in_proj.weight", torch.cat(rows)
            yield dst + "mixer.conv_weight", w(a + "conv1d.weight", cfg.conv_dim, W)
            yield dst + "mixer.dt_bias", w(a + "dt_bias", HV)
            yield dst + "mixer.A", -torch.exp(w(a + "A_log", HV))
            yield dst + "mixer.norm.weight", w(a + "norm.weight", V)  # plain multiplier, not zero-centred
            yield dst + "mixer.out_proj.weight", w(a + "out_proj.weight", E, HV * V)
        else:
            s = src + "self_attn."
            yield dst + "mixer.qkv_proj.weight", _attention_rows(
                w(s + "q_proj.weight", 2 * nh * hd, E), w(s + "k_proj.weight", nkv * hd, E),
                w(s + "v_proj.weight", nkv * hd, E), nh, hd)
            yield dst + "mixer.q_norm.weight", norm(s + "q_norm.weight", hd)
            yield dst + "mixer.k_norm.weight", norm(s + "k_norm.weight", hd)
            yield dst + "mixer.o_proj.weight", w(s + "o_proj.weight", E, nh * hd)
        m = src + "mlp."
        if cfg.ffn_types[i] == "dense":
            I = cfg.intermediate_size
            yield dst + "ffn.gate_up.weight", torch.cat([w(m + "gate_proj.weight", I, E),
                                                         w(m + "up_proj.weight", I, E)])
            yield dst + "ffn.down.weight", w(m + "down_proj.weight", E, I)
            continue
        n, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        yield dst + "ffn.router.weight", w(m + "gate.weight", n, E)
        if ckpt.has(m + "experts.gate_up_proj"):  # transformers' fused in-memory layout
            yield dst + "ffn.experts.gate_up", w(m + "experts.gate_up_proj", n, 2 * I, E)
            yield dst + "ffn.experts.down", w(m + "experts.down_proj", n, E, I)
        else:  # one module per expert, as published
            x = m + "experts."
            yield dst + "ffn.experts.gate_up", torch.stack([torch.cat(
                [w(f"{x}{e}.gate_proj.weight", I, E), w(f"{x}{e}.up_proj.weight", I, E)]) for e in range(n)])
            yield dst + "ffn.experts.down", torch.stack([w(f"{x}{e}.down_proj.weight", E, I) for e in range(n)])
        if S:
            sh = m + "shared_expert."
            yield dst + "ffn.shared.gate_up.weight", torch.cat([w(sh + "gate_proj.weight", S, E),
                                                                w(sh + "up_proj.weight", S, E)])
            yield dst + "ffn.shared.down.weight", w(sh + "down_proj.weight", E, S)
            yield dst + "ffn.shared_gate.weight", w(m + "shared_expert_gate.weight", 1, E)


def _weights_from_gguf(ckpt, cfg: QwenConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """llama.cpp layout: norms already hold 1 + w (except ssm_norm), ssm_a = -exp(A_log); Qwen3.5 value
    heads are tiled when HV != H (Qwen3-Next keeps them grouped, with ssm_ba per key head [b(r), a(r)]);
    old Qwen3-Next files carry the interleaved qkvz projection as ssm_in."""
    E, H, HV, K, V, W = (cfg.hidden_size, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim,
                         cfg.linear_v_dim, cfg.conv_kernel)
    r, nh, nkv, hd = HV // H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tiled = cfg.arch != "qwen3next" and r > 1

    def w(name, *shape):
        return fetch(ckpt, name, *shape)

    def rows(name, *shape):  # a large 2-D weight: read a block of rows at a time when it is stored
        return fetch_rows(ckpt, name, *shape)

    def grouped(t, dim, head):
        return _tiled_to_grouped(dense(t), dim, H, r, head) if tiled else t

    yield "embed.weight", fetch_rows(ckpt, "token_embd.weight", cfg.vocab_size, E)
    yield "norm.weight", w("output_norm.weight", E)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", fetch_rows(ckpt, "output.weight", cfg.vocab_size, E)
    for i, kind in enumerate(cfg.layer_types):  # nextn blocks (blk.{n_layers}...) are never read
        b, dst = f"blk.{i}.", f"layers.{i}."
        yield dst + "input_norm.weight", w(b + "attn_norm.weight", E)
        yield dst + "post_norm.weight", w(b + "post_attention_norm.weight", E)
        if kind == "linear_attention":
            if cfg.arch == "qwen3next" and not ckpt.has(b + "attn_qkv.weight") and ckpt.has(b + "ssm_in.weight"):
                q, k, v, z = _split_per_key_head(w(b + "ssm_in.weight", H * (2 * K + 2 * r * V), E),
                                                 H, [K, K, r * V, r * V])
            else:
                q, k, v = rows(b + "attn_qkv.weight", cfg.conv_dim, E).split([H * K, H * K, HV * V])
                v, z = grouped(v, 0, V), grouped(rows(b + "attn_gate.weight", HV * V, E), 0, V)
            if cfg.arch == "qwen3next":
                beta, alpha = _split_per_key_head(w(b + "ssm_ba.weight", 2 * HV, E), H, [r, r])
            else:
                beta = grouped(w(b + "ssm_beta.weight", HV, E), 0, 1)
                alpha = grouped(w(b + "ssm_alpha.weight", HV, E), 0, 1)
            yield dst + "mixer.in_proj.weight", stack_rows([q, k, v, z, beta, alpha])
            qk, conv_v = w(b + "ssm_conv1d.weight", cfg.conv_dim, W).split([2 * H * K, HV * V])
            yield dst + "mixer.conv_weight", torch.cat([qk, grouped(conv_v, 0, V)])
            yield dst + "mixer.dt_bias", grouped(w(b + "ssm_dt.bias", HV), 0, 1)
            yield dst + "mixer.A", grouped(w(b + "ssm_a", HV), 0, 1)
            yield dst + "mixer.norm.weight", w(b + "ssm_norm.weight", V)
            yield dst + "mixer.out_proj.weight", grouped(rows(b + "ssm_out.weight", E, HV * V), 1, V)
        else:
            if ckpt.has(b + "attn_q.weight"):
                q_gate, k, v = (w(b + "attn_q.weight", 2 * nh * hd, E), w(b + "attn_k.weight", nkv * hd, E),
                                w(b + "attn_v.weight", nkv * hd, E))
            else:
                q_gate, k, v = w(b + "attn_qkv.weight", (2 * nh + 2 * nkv) * hd, E).split(
                    [2 * nh * hd, nkv * hd, nkv * hd])
            yield dst + "mixer.qkv_proj.weight", _attention_rows(q_gate, k, v, nh, hd)
            yield dst + "mixer.q_norm.weight", w(b + "attn_q_norm.weight", hd)
            yield dst + "mixer.k_norm.weight", w(b + "attn_k_norm.weight", hd)
            yield dst + "mixer.o_proj.weight", rows(b + "attn_output.weight", E, nh * hd)
        if cfg.ffn_types[i] == "dense":
            I = cfg.intermediate_size
            yield dst + "ffn.gate_up.weight", stack_rows([rows(b + "ffn_gate.weight", I, E), rows(b + "ffn_up.weight", I, E)])
            yield dst + "ffn.down.weight", rows(b + "ffn_down.weight", E, I)
            continue
        n, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        yield dst + "ffn.router.weight", w(b + "ffn_gate_inp.weight", n, E)
        if ckpt.has(b + "ffn_gate_up_exps.weight"):  # gate rows first, then up
            yield dst + "ffn.experts.gate_up", w(b + "ffn_gate_up_exps.weight", n, 2 * I, E)
        else:
            yield dst + "ffn.experts.gate_up", torch.cat([w(b + "ffn_gate_exps.weight", n, I, E),
                                                          w(b + "ffn_up_exps.weight", n, I, E)], dim=1)
        yield dst + "ffn.experts.down", w(b + "ffn_down_exps.weight", n, E, I)
        if S:
            yield dst + "ffn.shared.gate_up.weight", torch.cat([w(b + "ffn_gate_shexp.weight", S, E),
                                                                w(b + "ffn_up_shexp.weight", S, E)])
            yield dst + "ffn.shared.down.weight", w(b + "ffn_down_shexp.weight", E, S)
            yield dst + "ffn.shared_gate.weight", w(b + "ffn_gate_inp_shexp.weight", 1, E)
