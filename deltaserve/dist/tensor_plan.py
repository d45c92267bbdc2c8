"""What each rank of tensor parallel holds, family by family: the model of 1/N-sized heads and columns it is
built as, and how each parameter of the whole model is shared out (`Share`).

Qwen (qwen35, qwen35moe, qwen3next; the weight tables give all three one internal layout, value heads
grouped): Gated DeltaNet by groups of key heads with their value heads, the conv channels, decay and step
size following; gated attention by KV-head groups with their query heads; the dense MLP and the shared
expert by intermediate columns; routed experts by expert (rank n holds experts n*E/N .. (n+1)*E/N - 1, the
router and the shared expert's gate whole).
Kimi Linear: KDA by heads (q, k, v rows with their conv channels, f_b / g_b rows, dt_bias, A and beta; the
low-rank f_a and g_a, D wide, whole); MLA by heads (q or q_b rows, kv_b), the latent projection kv_a whole:
the latent is every head's, so each rank keeps the whole latent cache (`kv_shared`); MLPs and MoE as Qwen's.
Every output projection (out_proj, o_proj, down) is split by its input columns: its product is a partial sum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.models.base import HybridModel
from deltaserve.models.layers import MLP, Experts


@dataclass(frozen=True)
class Share:
    """How one parameter is shared out over N ranks. rows: consecutive blocks of the first axis, (size,
    split) each: rank n holds part n of a split block (rows s + n*size//N .. s + (n+1)*size//N - 1), all of
    a whole one. columns: the last axis in N equal parts. vocab: rows in parts of ceil(V/N), the last one
    padded with zero rows. None of them: every rank holds it whole."""

    rows: tuple[tuple[int, bool], ...] = ()
    columns: bool = False
    vocab: bool = False

    def ranges(self, n: int, N: int, total: int) -> list[tuple[int, int]]:
        """Rank n's rows (start, end) of a first axis of `total`, in order."""
        if self.vocab:
            per = math.ceil(total / N)
            return [(min(n * per, total), min((n + 1) * per, total))]
        out, start = [], 0
        for size, split in self.rows:
            out.append((start + n * size // N, start + (n + 1) * size // N) if split else (start, start + size))
            start += size
        return out


WHOLE = Share()
COLUMNS = Share(columns=True)
VOCAB = Share(vocab=True)


def split(*sizes: int) -> Share:
    """Row blocks of these sizes, each split over the ranks."""
    return Share(rows=tuple((s, True) for s in sizes))


def _mlp_shares(prefix: str, width: int) -> dict[str, Share]:
    return {f"{prefix}gate_up.weight": split(width, width), f"{prefix}down.weight": COLUMNS}


def _ffn_shares(num_experts: int, shared: int, dense: int) -> dict[str, Share]:
    """A dense MLP of width `dense` and an MoE of `num_experts` with a shared expert of width `shared`."""
    return {**_mlp_shares("ffn.", dense), **_mlp_shares("ffn.shared.", shared),
            "ffn.experts.gate_up": split(num_experts), "ffn.experts.down": split(num_experts)}


def qwen_shares(cfg) -> dict[str, Share]:
    """Shares of a Qwen layer's parameters, by their names within the layer."""
    qk, v = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_v_heads * cfg.linear_v_dim
    q, kv, HV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.linear_v_heads
    return {"mixer.in_proj.weight": split(qk, qk, v, v, HV, HV),  # q | k | v | z | b | a
            "mixer.conv_weight": split(qk, qk, v), "mixer.dt_bias": split(HV), "mixer.A": split(HV),
            "mixer.out_proj.weight": COLUMNS,
            "mixer.qkv_proj.weight": split(q, q, kv, kv),  # query | gate | key | value
            "mixer.o_proj.weight": COLUMNS,
            **_ffn_shares(cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.intermediate_size)}


def kimi_shares(cfg) -> dict[str, Share]:
    H, D, C, nh = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.num_heads
    q = nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return {"mixer.in_proj.weight": Share(rows=((C, True), (C, True), (C, True), (D, False), (D, False), (H, True))),
            "mixer.conv_weight": split(C, C, C), "mixer.f_b.weight": split(C), "mixer.g_b.weight": split(C),
            "mixer.dt_bias": split(C), "mixer.A": split(H), "mixer.out_proj.weight": COLUMNS,
            "mixer.q_proj.weight": split(q), "mixer.q_b.weight": split(q), "mixer.kv_b": split(nh),
            "mixer.o_proj.weight": COLUMNS,
            **_ffn_shares(cfg.num_experts, cfg.shared_intermediate_size, cfg.intermediate_size)}


def _check(N: int, sizes: dict[str, int], family: str) -> None:
    odd = [f"{k} {v}" for k, v in sizes.items() if v % N]
    if odd:
        raise DeltaserveError(f"--tp {N} must divide {family}'s head counts and MLP widths: {', '.join(odd)} "
                              "(use --pp, or a --tp that divides them)")


def small_config(cfg, N: int):
    """The config of one rank's model (1/N of every split size; whole heads), after checking that N divides
    them; its vocabulary is one shard of ceil(V/N) rows."""
    ffns = set(cfg.ffn_types)
    if "moe" in ffns and cfg.num_experts < N:
        raise DeltaserveError(f"--tp {N} splits MoE layers by expert, but the model has {cfg.num_experts} experts")
    if hasattr(cfg, "linear_k_heads"):  # Qwen
        sizes = dict(linear_k_heads=cfg.linear_k_heads, linear_v_heads=cfg.linear_v_heads,
                     num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
        if "dense" in ffns:
            sizes["intermediate_size"] = cfg.intermediate_size
        if "moe" in ffns:
            sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        _check(N, sizes, cfg.arch)
    else:
        sizes = dict(kda_heads=cfg.kda_heads, num_heads=cfg.num_heads)
        if "dense" in ffns:
            sizes["intermediate_size"] = cfg.intermediate_size
        _check(N, sizes | ({"shared expert width": cfg.shared_intermediate_size} if "moe" in ffns else {}),
               "kimi-linear")
    return dataclasses.replace(cfg, **{k: v // N for k, v in sizes.items()}, vocab_size=math.ceil(cfg.vocab_size / N))


def small_model(model: HybridModel, n: int, N: int) -> HybridModel:
    """Rank n's model on the meta device: the small config's, without the MTP layer (not split), each MoE
    holding its rank's experts and 1/N of the shared expert."""
    cfg = model.config
    small = small_config(cfg, N)
    with torch.device("meta"):
        out = type(model)(small, compute_dtype=model.compute_dtype, cache_dtype=model.cache_dtype, mtp=False)
        for layer in out.layers:
            experts = getattr(layer.ffn, "experts", None)
            if experts is None:
                continue
            E = cfg.num_experts
            first, last = n * E // N, (n + 1) * E // N
            layer.ffn.experts = Experts(last - first, cfg.hidden_size, cfg.moe_intermediate_size, first=first)
            shared = getattr(cfg, "shared_intermediate_size", None)  # Kimi's: derived, not a config field
            if shared:
                layer.ffn.shared = MLP(cfg.hidden_size, shared // N)
    return out.requires_grad_(False)


TRUNK = {"embed.weight": VOCAB, "lm_head.weight": VOCAB}  # the final norm: whole


def layer_shares(model: HybridModel) -> dict[str, Share]:
    """The shares of a layer's parameters, by their names within the layer (WHOLE where not named)."""
    cfg = model.config
    return qwen_shares(cfg) if hasattr(cfg, "linear_k_heads") else kimi_shares(cfg)


def kv_shared(model: HybridModel) -> bool:
    """Whether every rank keeps the whole KV rows (Kimi's MLA latent) rather than its heads' share."""
    return not hasattr(model.config, "num_kv_heads")
