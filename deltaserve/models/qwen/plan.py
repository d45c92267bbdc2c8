"""A decode step (one token per sequence) of a dense Qwen model in one C++ call (ops/csrc/plan.h): the same kernels
the modules call, without the ~1,300 small torch ops and their Python a step costs through them (3-4 ms a token
on a 24-layer model on a 2-core EPYC, where a 0.8B Q4_K_M decode step takes 20-30 ms).

It applies where every layer is a Gated DeltaNet or gated attention layer with a dense SwiGLU MLP, float32
activations on CPU with the C++ kernels built, every matmul weight in a form its kernels read without bias, float32
recurrent caches and a KV cache the attention step kernel reads; elsewhere (MoE layers, prefill, long spans split
across threads, training) the modules run. A speculative verify pass (a few tokens per sequence, keeping per-token
snapshots for rollback) runs through the same plan: on a 7.5M-parameter model the modules' Python made it cost ten
plain steps. The plan is built once per range of layers.

The MTP layer (models/mtp.py) has a plan of its own (MTPPlan): k chained greedy drafts in one call, and the keys and
values a trunk pass leaves in its cache without its attention output (through the modules a draft step cost ~50
small torch ops, 0.3 ms on the embedded model where its arithmetic takes a fifth of that). It applies where the
embedding is float32, float16 or bfloat16 (a dense or MoE feed-forward alike); elsewhere (quantised embeddings)
models/mtp.py runs the modules, with the same drafts. It reads float MTP weights and the head
through Q8_0 copies (models/mtp.py DRAFT_Q8), as the modules do not: its drafts are then those of the rounded weights.
"""

from __future__ import annotations

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.models import layers as layer_ops
from deltaserve.models import packed
from deltaserve.models import mtp as mtp_layer
from deltaserve.models.layers import (GEMV_ROWS, _STEP_CACHE_DTYPES, MLP, Q8_BLOCK, STEP_TOKENS, SparseMoE,
                                      _split_decode, part, q8_int8)
from deltaserve.ops import fused

_NONE = torch.empty(0)  # a layer's missing cache or gather


def step(model, h: torch.Tensor, rope, state, slots: torch.Tensor, start: torch.Tensor, layers: range, snaps=None):
    """h [N, 1, E] through `layers` in one call, or None where the plan does not apply. snaps (models/state.py
    Snapshots): a verify pass, h [N, T, E] with T <= the GEMV rows in all, that also keeps each recurrent layer's
    conv tape and delta-rule states there for rollback."""
    N, T, E = h.shape
    if (T != 1 and (snaps is None or N * T > GEMV_ROWS)) or h.dtype != torch.float32 or not h.is_cpu \
            or not fused.available():
        return None
    plan = _plan(model, layers)
    caches = None if plan is None else _caches(model, state, layers, N, T, start)
    if caches is None:
        return None
    cos, sin = (_NONE, _NONE) if rope is None else (t.reshape(N * T, -1).contiguous() for t in rope)  # None: no attention
    rows = h.reshape(N * T, E).clone()
    if snaps is None:
        return plan.step(rows, slots, start, cos, sin, *caches).view(N, 1, E)
    out, tapes, kept = plan.verify(rows, T, slots, start, cos, sin, *caches, snaps.depth)
    for j, i in enumerate(layers):
        if model.layers[i].recurrent:
            snaps.conv[i], snaps.ssm[i] = tapes[j], kept[j]
    return out.view(N, T, E)


def _caches(model, state, layers: range, N: int, T: int, start: torch.Tensor):
    """The caches of `layers` as the plan takes them (conv, ssm, keys, values: one entry per layer, empty where the
    layer has none), or None where one is not the plan's case."""
    conv, ssm, keys, values = [], [], [], []
    for i in layers:
        if model.layers[i].recurrent:
            c, s = state.conv[i], state.ssm[i]
            if not (c.dtype == s.dtype == torch.float32 and c.is_contiguous() and s.is_contiguous()):
                return None
            conv.append(c), ssm.append(s), keys.append(_NONE), values.append(_NONE)
        else:
            k, v = state.k[i], state.v[i]
            if (k.dtype not in _STEP_CACHE_DTYPES or v.dtype != k.dtype or not k.is_cpu
                    or (T <= STEP_TOKENS and _split_decode(N * model.layers[i].mixer.num_kv_heads, start))):
                return None
            conv.append(_NONE), ssm.append(_NONE), keys.append(k), values.append(v)
    return conv, ssm, keys, values


def _plan(model, layers: range):
    """The model's plan for `layers` (built at first use), or None where some layer is not the plan's case. The
    switches of the activations' rounding are part of the key: a plan holds the kernels they chose."""
    plans = model.__dict__.setdefault("_decode_plans", {})
    key = (layers.start, layers.stop, packed.INT8_ACTIVATIONS, layer_ops.Q8_INT8_ACTIVATIONS,
           layer_ops.BF16_ROUNDED_ACTIVATIONS)
    if key not in plans:
        plans[key] = _build_layers(fused.extension(), [model.layers[i] for i in layers])
    return plans[key]


def _build_layers(ext, layers: list, draft: bool = False):
    """A DecodePlan of these decoder layers, or None where one is not the plan's case. draft: float weights are
    read through Q8_0 copies (see _weight_ref)."""
    plan = ext.DecodePlan()
    for layer in layers:
        mixer, norms = layer.mixer, (layer.input_norm.weight, layer.post_norm.weight)
        if layer.input_norm.eps != layer.post_norm.eps or any(t.dtype != torch.float32 for t in norms):
            return None
        ffn = _feed_forward(ext, layer.ffn, draft)  # (first: a tensor-parallel rank's modules are wrapped, see there)
        if ffn is None:
            return None
        linears = [_linear(ext, m, draft) for m in ((mixer.in_proj, mixer.out_proj) if layer.recurrent
                                                    else (mixer.qkv_proj, mixer.o_proj))]
        if any(ref is None for ref in linears):
            return None
        if layer.recurrent:
            plan.add_gdn(*norms, layer.input_norm.eps, *linears, ffn, mixer.conv_weight, mixer.A, mixer.dt_bias,
                         mixer.norm.weight, mixer.norm.eps, mixer.H)
        else:
            plan.add_attention(*norms, layer.input_norm.eps, *linears, ffn, mixer.q_norm.weight, mixer.k_norm.weight,
                               mixer.q_norm.eps, mixer.num_heads)
    return plan


def _feed_forward(ext, ffn, draft: bool = False):
    """The C++ FeedForward of an MLP or a SparseMoE holding all its experts, or None where one of its weights has
    no kernel (or the module is another: a tensor-parallel rank's wraps its output in an all-reduce)."""
    if isinstance(ffn, MLP):
        refs = [_linear(ext, ffn.gate_up, draft)], [_linear(ext, ffn.down, draft)]
        return None if None in refs[0] + refs[1] else ext.FeedForward(*refs, None, 1, False, None, None, None)
    if not isinstance(ffn, SparseMoE) or ffn.experts.first != 0:
        return None
    experts = ffn.experts
    refs = [[_weight_ref(ext, part(w, e), draft) for e in range(w.shape[0])] for w in (experts.gate_up, experts.down)]
    router = _linear(ext, ffn.router, draft)
    shared = [None] * 3 if ffn.shared is None else \
        [_linear(ext, m, draft) for m in (ffn.shared_gate, ffn.shared.gate_up, ffn.shared.down)]
    if None in refs[0] + refs[1] or router is None or (ffn.shared is not None and None in shared):
        return None
    return ext.FeedForward(*refs, router, ffn.top_k, ffn.normalize, *shared)


def _linear(ext, module, draft: bool = False):
    """The C++ LinearRef of a Linear module's weight (kinds as plan.h numbers them), or None."""
    return None if module.bias is not None else _weight_ref(ext, module.weight, draft)


def _weight_ref(ext, w: torch.Tensor, draft: bool = False):
    """The C++ LinearRef of x @ w.T for a weight in any form linear() reads, or None where the plan has no kernel.
    draft: a float weight is read through a Q8_0 copy of it where the CPU has the int8 kernels (the MTP layer's
    drafts: half the bytes of float16, and only guesses, which verification checks)."""
    if draft and w.dtype in (torch.float16, torch.bfloat16, torch.float32) and w.dim() == 2 \
            and w.shape[1] % Q8_BLOCK == 0 and q8_int8(torch.empty(0, w.shape[1])):
        w = mtp_layer.q8_0_copy(w)
    if packed.is_packed(w):
        pk = w.packing
        index = _NONE.long() if pk.x_index is None else pk.x_index
        return ext.LinearRef(0 if packed.uses_int8(w) else 4, w, pk.table, index, *pk.shape)
    N, K = w.shape
    if w.dtype == torch.int8 and q8_int8(torch.empty(0, K)):
        return ext.LinearRef(1, w, w.scale, _NONE.long(), N, K)
    kinds = {torch.float16: 2, torch.float32: 3, torch.bfloat16: 5 if layer_ops.BF16_ROUNDED_ACTIVATIONS else 6}
    if w.dtype in kinds and w.is_contiguous():
        return ext.LinearRef(kinds[w.dtype], w, _NONE, _NONE.long(), N, K)
    return None


def mtp_follow(model, ids: torch.Tensor, before: torch.Tensor, rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: torch.Tensor, start: torch.Tensor) -> bool:
    """The MTP layer's keys and values for ids [N, T] after normed hidden states before [N, T, E] (each token's
    predecessor's), at positions start..; False where the plan does not apply (nothing written)."""
    N, T, E = before.shape
    if (N * T > GEMV_ROWS and not _draft_copies(before)) or not _applies(before, k_cache, v_cache):
        return False  # a prompt's pass: float weights' kernels in the plan are GEMVs, Q8_0 copies' GEMMs too
    plan = _mtp_plan(model)
    if plan is None:
        return False
    cos, sin = (t.reshape(N * T, -1).contiguous() for t in rope)
    plan.follow(ids.reshape(-1).contiguous(), before.reshape(N * T, E).contiguous(), T, slots, start, cos, sin,
                k_cache, v_cache)
    return True


def mtp_draft(model, state, slots: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
          ks: list[int]) -> list[list[int]] | None:
    """ks[n] greedy chained drafts after ids [N] (each slot's pending token) from hidden [N, E] (the trunk's normed
    state after the slot's last token), writing the MTP cache at the drafted positions; None where the plan does
    not apply."""
    i = len(model.layers)
    k_cache, v_cache = state.k[i], state.v[i]
    if len(ks) > GEMV_ROWS or not _applies(hidden, k_cache, v_cache):
        return None
    plan = _mtp_plan(model)
    if plan is None:
        return None
    start = state.lengths[slots]
    cos, sin = model.rope(start[:, None] + torch.arange(max(ks), device=start.device))  # [N, k, rot]
    out = plan.draft(ids.contiguous(), hidden.float().contiguous(), slots, start.contiguous(), cos.contiguous(),
                     sin.contiguous(), k_cache, v_cache, ks)
    return [row[:k] for row, k in zip(out.tolist(), ks)]


def mtp_greedy_step(model, state, slots: torch.Tensor, ids: torch.Tensor, ks: list[int]):
    """A greedy speculative step in one call (ops/csrc/spec.h): slot slots[n] with pending token ids[n] drafts ks[n]
    >= 1 tokens with the MTP layer (as mtp_draft), the trunk verifies [pending, drafts] (as a forward pass keeping
    snapshots) and the slot keeps the pending token and the accepted drafts (as HybridState.rollback). -> drafts
    [N, max k] (-1 past ks[n]), accepted drafts [N], the trunk's next token [N]; None where the plans do not apply
    (nothing written: the caller drafts and verifies in steps)."""
    N, T, i = len(ks), 1 + max(ks), len(model.layers)
    if N * T > GEMV_ROWS or min(ks) < 1 or not _applies(state.conv[i], state.k[i], state.v[i]):
        return None
    if int(slots.min()) < 0 or int(slots.max()) >= state.n_slots:
        raise DeltaserveError(f"mtp_greedy_step: slots {slots.tolist()} outside [0, {state.n_slots})")
    spec = _spec_plan(model)
    start = state.lengths[slots]
    caches = None if spec is None else _caches(model, state, range(i), N, T, start)
    if caches is None:
        return None
    cos, sin = model.rope(start[:, None] + torch.arange(T))  # [N, T, rot]
    drafts, accepted, following = spec.step(ids.contiguous(), slots, start.contiguous(), cos.contiguous(),
                                            sin.contiguous(), *caches, state.k[i], state.v[i], state.conv[i], ks)
    state.lengths[slots] = start + accepted + 1
    state.snapshots = None  # (the rollback is done: the pass leaves none)
    return drafts, accepted, following


def _spec_plan(model):
    """The model's GreedySpec (built at first use over its decode and MTP plans), or None where one has none."""
    plans = model.__dict__.setdefault("_decode_plans", {})
    key = ("spec", mtp_layer.DRAFT_Q8, packed.INT8_ACTIVATIONS, layer_ops.Q8_INT8_ACTIVATIONS,
           layer_ops.BF16_ROUNDED_ACTIVATIONS)
    if key not in plans:
        trunk, mtp = _plan(model, range(len(model.layers))), _mtp_plan(model)
        head = _weight_ref(fused.extension(), model.embed.weight if model.lm_head is None else model.lm_head.weight)
        norm = model.norm
        plans[key] = None if trunk is None or mtp is None or head is None or norm.weight.dtype != torch.float32 \
            else fused.extension().GreedySpec(trunk, mtp, model.embed.weight, norm.weight, norm.eps, head)
    return plans[key]


def _applies(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.is_cpu and k_cache.dtype in _STEP_CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.is_cpu and fused.available())


def _draft_copies(x: torch.Tensor) -> bool:
    """Whether the MTP plan reads float weights through Q8_0 copies (models/mtp.py DRAFT_Q8, on a CPU with the
    kernels)."""
    return mtp_layer.DRAFT_Q8 and q8_int8(x)


def _mtp_plan(model):
    """The model's MTPPlan (built at first use, keyed like the decode plans by the activations' rounding), or None."""
    plans = model.__dict__.setdefault("_decode_plans", {})
    key = ("mtp", mtp_layer.DRAFT_Q8, packed.INT8_ACTIVATIONS, layer_ops.Q8_INT8_ACTIVATIONS,
           layer_ops.BF16_ROUNDED_ACTIVATIONS)
    if key not in plans:
        plans[key] = _build_mtp(model)
    return plans[key]


def _build_mtp(model):
    mtp, ext = model.mtp, fused.extension()
    embed = model.embed.weight
    if (mtp is None or packed.is_packed(embed) or embed.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or not embed.is_contiguous() or len({mtp.enorm.eps, mtp.hnorm.eps, mtp.norm.eps}) != 1):
        return None
    q8 = mtp_layer.DRAFT_Q8
    layer = _build_layers(ext, [mtp.layer], q8)
    head = _weight_ref(ext, embed if model.lm_head is None else model.lm_head.weight, q8)
    fc = None if mtp.fc.bias is not None else _weight_ref(ext, mtp.fc.weight, q8)
    if layer is None or head is None or fc is None:
        return None
    return ext.MTPPlan(embed, mtp.enorm.weight, mtp.hnorm.weight, mtp.enorm.eps, fc, layer, mtp.norm.weight, head)
