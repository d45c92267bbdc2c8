"""The MTP layer of a dense Qwen model in one C++ call per use (ops/csrc/mtp_plan.h): k chained greedy drafts, and
the keys and values a trunk pass leaves in the layer's cache (models/mtp.py `follow`). Through the modules a draft
step cost ~50 small torch ops and their Python, 0.3 ms on the embedded 7.5M-parameter model where its arithmetic
takes a fifth of that, and the cache writes ran the whole attention and output projection only to drop them.

It applies where the layer's feed-forward is a dense MLP, every weight is in a form the decode plan reads, the
embedding is float32 or float16, activations are float32 on CPU and the KV cache is one the step kernel reads;
elsewhere (qwen35moe's MoE layer, quantised embeddings) models/mtp.py runs the modules. Both give the same drafts.
"""

from __future__ import annotations

import torch

from deltaserve.models import layers as layer_ops
from deltaserve.models import packed
from deltaserve.models.layers import _GEMV_ROWS, _STEP_CACHE_DTYPES
from deltaserve.models.qwen.plan import build, weight_ref
from deltaserve.ops import fused


def follow(model, ids: torch.Tensor, before: torch.Tensor, rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: torch.Tensor, start: torch.Tensor) -> bool:
    """The MTP layer's keys and values for ids [N, T] after normed hidden states before [N, T, E] (each token's
    predecessor's), at positions start..; False where the plan does not apply (nothing written)."""
    N, T, E = before.shape
    if N * T > _GEMV_ROWS or not _applies(before, k_cache, v_cache):
        return False
    plan = _mtp_plan(model)
    if plan is None:
        return False
    cos, sin = (t.reshape(N * T, -1).contiguous() for t in rope)
    plan.follow(ids.reshape(-1).contiguous(), before.reshape(N * T, E).contiguous(), T, slots, start, cos, sin,
                k_cache, v_cache)
    return True


def draft(model, state, slots: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
          ks: list[int]) -> list[list[int]] | None:
    """ks[n] greedy chained drafts after ids [N] (each slot's pending token) from hidden [N, E] (the trunk's normed
    state after the slot's last token), writing the MTP cache at the drafted positions; None where the plan does
    not apply."""
    i = len(model.layers)
    k_cache, v_cache = state.k[i], state.v[i]
    if len(ks) > _GEMV_ROWS or not _applies(hidden, k_cache, v_cache):
        return None
    plan = _mtp_plan(model)
    if plan is None:
        return None
    start = state.lengths[slots]
    cos, sin = model.rope(start[:, None] + torch.arange(max(ks), device=start.device))  # [N, k, rot]
    out = plan.draft(ids.contiguous(), hidden.float().contiguous(), slots, start.contiguous(), cos.contiguous(),
                     sin.contiguous(), k_cache, v_cache, ks)
    return [row[:k] for row, k in zip(out.tolist(), ks)]


def _applies(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.is_cpu and k_cache.dtype in _STEP_CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.is_cpu and fused.available())


def _mtp_plan(model):
    """The model's MTPPlan (built at first use, keyed like the decode plans by the activations' rounding), or None."""
    plans = model.__dict__.setdefault("_decode_plans", {})
    key = ("mtp", packed.INT8_ACTIVATIONS, layer_ops.Q8_INT8_ACTIVATIONS)
    if key not in plans:
        plans[key] = _build(model)
    return plans[key]


def _build(model):
    mtp, ext = model.mtp, fused.extension()
    embed = model.embed.weight
    if (mtp is None or packed.is_packed(embed) or embed.dtype not in (torch.float16, torch.float32)
            or not embed.is_contiguous() or len({mtp.enorm.eps, mtp.hnorm.eps, mtp.norm.eps}) != 1):
        return None
    layer = build(ext, [mtp.layer])
    head = weight_ref(ext, embed if model.lm_head is None else model.lm_head.weight)
    fc = None if mtp.fc.bias is not None else weight_ref(ext, mtp.fc.weight)
    if layer is None or head is None or fc is None:
        return None
    return ext.MTPPlan(embed, mtp.enorm.weight, mtp.hnorm.weight, mtp.enorm.eps, fc, layer, mtp.norm.weight, head)
