"""Building blocks shared by the hybrid models: RMSNorm, partial rotary embedding, gated attention over
a per-slot KV cache (or none, for training), SwiGLU MLP and mixtures of experts routed by softmax or by
sigmoid with a bias.

Weights are stored ready to compute: norms hold their final multiplier (float32), fused projections
hold their row blocks in the order `forward` splits them. Checkpoint quirks live in the model files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.loader.memory import weight_empty
from deltaserve.models import packed
from deltaserve.ops import attention as attention_op
from deltaserve.ops import fused

# Up to this many rows a float16 or Q8_0 weight goes through a fused GEMV (decode: the weight streams from memory
# once and is widened in registers; a row's result is the same bits whatever the batch, as speculative verify
# needs); above it a float16 weight goes through our GEMM (ops/csrc/f16gemm.h), a Q8_0 one (float32 activations)
# through a float32 GEMM on the widened weight.
GEMV_ROWS = 16
Q8_BLOCK = 32  # weights per scale in a Q8_0 row
# Q8_0 weights multiply activations rounded per 32 to Q8_0, as llama.cpp does on these files (its speed and its
# rounding; ops/csrc/int8q8.h, int8legacy_avx2.h), where the build has AVX-512 VNNI or AVX2. False: float32
# activations (exact weights).
Q8_INT8_ACTIVATIONS = True
# bfloat16 weights multiply activations rounded to bfloat16 (vdpbf16ps), as llama.cpp and transformers do beside
# them, where this CPU has AVX512_BF16 (ops/csrc/bf16.h). False: float32 activations (exact weights), slower.
BF16_ROUNDED_ACTIVATIONS = True
_DEQUANT_BYTES = 4 << 20  # a torch GEMM on a narrower weight widens this much of it at a time


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype, whatever form the weight is stored in: x's dtype, float16, bfloat16, Q8_0
    (int8 with a `.scale`, see quantize_q8) or a file's GGML blocks (see models/packed.py). The smaller forms
    keep a half to an eighth of the memory and bandwidth of float32 ones while the activations, and so the
    result, stay float32."""
    if packed.is_packed(weight):
        return packed.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and bf16_kernel(x):
        return _linear_bf16(x, weight, bias)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if weight.dtype == torch.int8 and q8_int8(x):
        y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
        fused.extension().linear_q8_int8(fused.kernel_rows(rows.float()), weight, weight.scale, y)
        y = y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)
    if (x.dtype == torch.float32 and x.device.type == "cpu" and fused.available()
            and (weight.dtype == torch.float16 or weight.dtype == torch.int8 and rows.shape[0] <= GEMV_ROWS)):
        y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
        if weight.dtype == torch.int8:
            fused.extension().linear_q8(rows.contiguous(), weight, weight.scale, y)
        elif rows.shape[0] <= GEMV_ROWS:
            fused.extension().linear_f16(rows.contiguous(), weight.contiguous(), y)
        else:  # prefill: our GEMM on the weight as stored (ops/csrc/f16gemm.h)
            fused.extension().linear_f16_gemm(fused.kernel_rows(rows), weight.contiguous(), y)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)
    step = max(64, _DEQUANT_BYTES // (x.element_size() * weight.shape[1]))  # output rows per block
    if weight.shape[0] <= step:
        return F.linear(x, dequantize(weight, x.dtype), None if bias is None else bias.to(x.dtype))
    # Widened a block of output rows at a time: the temporary stays a few MB (not 1 GB for a 248k-row
    # output head) and hot in cache for its GEMM, which measured as fast or faster than one GEMM here.
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    y2 = y.view(-1, weight.shape[0])
    for r in range(0, weight.shape[0], step):
        torch.mm(rows, dequantize(part(weight, slice(r, r + step)), x.dtype).T, out=y2[:, r:r + step])
    return y if bias is None else y + bias.to(y.dtype)


def bf16_kernel(x: torch.Tensor) -> bool:
    """Whether linear() multiplies bfloat16 weights by activations x in ops/csrc/bf16.h: float32 on CPU (rounded to
    bfloat16 there where BF16_ROUNDED_ACTIVATIONS and the build has AVX512_BF16)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and fused.available()


def _linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight [N, K] bfloat16 ^T (+ bias): decode and prefill in one kernel (bf16.h)."""
    rows = fused.kernel_rows(x.reshape(-1, x.shape[-1]))
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    fused.extension().linear_bf16(rows, weight.contiguous(), y, BF16_ROUNDED_ACTIVATIONS)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def q8_int8(x: torch.Tensor) -> bool:
    """Whether linear() multiplies Q8_0 weights by x rounded to Q8_0 (see Q8_INT8_ACTIVATIONS)."""
    return (Q8_INT8_ACTIVATIONS and x.device.type == "cpu" and x.shape[-1] % Q8_BLOCK == 0 and fused.available()
            and fused.extension().q8_int8())


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values in `dtype`, whatever form it is stored in."""
    if packed.is_packed(weight):
        return packed.dequantize(weight, dtype)
    if weight.dtype != torch.int8:
        return weight.to(dtype)
    N, K = weight.shape
    blocks = weight.view(N, K // Q8_BLOCK, Q8_BLOCK).to(dtype)
    return blocks.mul_(weight.scale.to(dtype)[..., None]).view(N, K)  # in place: one temporary, not two


def embed_tokens(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table stored in any form linear() takes, in `dtype`. [..., E]"""
    if packed.is_packed(weight):
        return packed.embed(weight, ids, dtype)
    rows = F.embedding(ids, weight).to(dtype)  # [..., E]
    if weight.dtype != torch.int8:
        return rows
    scale = F.embedding(ids, weight.scale).to(dtype)  # [..., E / 32]
    return (rows.unflatten(-1, (-1, Q8_BLOCK)) * scale[..., None]).flatten(-2)


def quantize_q8(w: torch.Tensor, rows_per_pass: int = 2048) -> nn.Parameter | None:
    """w [..., N, K] float32 in Q8_0 form when it holds exactly such values, as the weights of a Q8_0 file
    do once dequantised: an int8 parameter [..., N, K] carrying `.scale`, float16 [..., N, K / 32], with
    w[n, k] == scale[n, k // 32] * q[n, k]. None when any block is not exactly that (the caller then keeps
    another dtype), so storing a weight this way never changes its values."""
    if w.dim() < 2 or w.dtype != torch.float32 or w.shape[-1] % Q8_BLOCK:
        return None
    *shape, K = w.shape
    w = w.reshape(-1, K) if w.dim() > 2 else w  # 2-D as it is: a checkpoint's row reader slices like one
    N = w.shape[0]
    q = weight_empty((N, K), torch.int8)
    # the scales, streamed beside the codes, in 2 MB pages too: in 4 KB ones the 0.8B Q8_0 file's decode GEMVs took
    # 57-61 ms a token where 44 in these (the AMX Xeon's AVX2 build; the hardware prefetchers stop at page ends)
    scale = weight_empty((N, K // Q8_BLOCK), torch.float16)
    for r in range(0, N, rows_per_pass):  # in slices: a float32 temporary the size of w would double the peak
        blocks = w[r:r + rows_per_pass].reshape(-1, K // Q8_BLOCK, Q8_BLOCK)
        d = blocks.abs().amax(-1) / 127  # the largest weight of a Q8_0 block is +-127 * its scale
        d16 = d.to(torch.float16)
        if not torch.equal(d16.float(), d):
            return None
        qf = torch.round(blocks / torch.where(d > 0, d, 1.0)[..., None])
        if not torch.equal(qf * d[..., None], blocks):
            return None
        q[r:r + rows_per_pass] = qf.reshape(-1, K).to(torch.int8)
        scale[r:r + rows_per_pass] = d16
    param = nn.Parameter(q.view(*shape, K), requires_grad=False)
    param.scale = scale.view(*shape, K // Q8_BLOCK)
    return param


class Linear(nn.Linear):
    """nn.Linear whose weight may be stored in another dtype than the activations (see linear())."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """The token embedding table [vocab, E], in any form embed_tokens() reads. Not nn.Embedding: its
    random init, run on the meta device while a model is built, imports torch._dynamo and sympy (1 s, ~60 MB)."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return embed_tokens(self.weight, ids, dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 (weight is the final multiplier); with a
    gate, times silu(gate) or sigmoid(gate) too (the output gates of GDN and KDA layers)."""

    GATES = {"silu": (1, F.silu), "sigmoid": (2, torch.sigmoid)}

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None, gate_act: str = "silu",
                inplace: bool = False) -> torch.Tensor:
        """x [..., D]; gate like x (any strides) or None. inplace: x may be overwritten (it is at inference)."""
        if _fused_inference(x, self.weight, gate) and x.is_contiguous():  # one C++ call
            out = x if inplace else torch.empty_like(x)
            rows = fused.EMPTY_F32 if gate is None else gate.reshape(-1, *gate.shape[-2:])  # [tokens, R, D]
            if gate is not None and rows.stride(-1) != 1:
                rows = rows.contiguous()
            fused.extension().rms_norm(x, self.weight, self.eps, out, rows, self.GATES[gate_act][0])
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (x32 if gate is None else x32 * self.GATES[gate_act][1](gate.float())).to(x.dtype)


def _fused_inference(*tensors: torch.Tensor | None) -> bool:
    """Whether the C++ kernels may compute this: inference (no autograd), float32 CPU tensors, kernels built."""
    return (not torch.is_grad_enabled() and fused.available()
            and all(t is None or (t.dtype == torch.float32 and t.is_cpu) for t in tensors))


_STEP_CACHE_DTYPES = (torch.float32, torch.float16)  # KV caches the attention step kernel reads
# From this many cached tokens, a decode step with fewer (sequence, kv head) pairs than threads attends
# through the tiled kernel (cached_attention), which splits the keys across the idle threads; the one-call
# step kernel threads over those pairs only.
_SPLIT_DECODE_SPAN = 2048
# A cached pass of at most this many tokens per sequence (a speculative verify pass) runs its attention and the
# recurrent layers' conv and delta rule token by token, each exactly as a decode step (ops/csrc/conv.h,
# delta_rule.h, plan.h keep the same bound): its logits are then a decode step's bits, and greedy speculative
# decoding gives plain decoding's tokens even where two logits nearly tie.
STEP_TOKENS = 8


def _split_decode(pairs: int, start: torch.Tensor) -> bool:
    return pairs < torch.get_num_threads() and int(start.max()) >= _SPLIT_DECODE_SPAN


def swiglu(gate_up: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim, [..., 2I] -> [..., I]. inplace: at inference
    the result is written over gate and returned as that slice of gate_up (rows 2I apart)."""
    if _fused_inference(gate_up) and gate_up.stride(-1) == 1:
        rows, I = gate_up.reshape(-1, gate_up.shape[-1]), gate_up.shape[-1] // 2
        if inplace and gate_up.is_contiguous():  # rows is then gate_up itself
            fused.extension().silu_mul(rows, rows[:, :I])
            return gate_up[..., :I]
        out = torch.empty(*gate_up.shape[:-1], I)
        fused.extension().silu_mul(rows, out.view(rows.shape[0], I))
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """NeoX-style rope on the first `dim` channels of each head (the rest pass through)."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> cos, sin [N, T, dim] in float32."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=positions.device) / self.dim
        inv_freq = 1.0 / (self.theta ** exponents)  # [dim/2]
        freqs = positions.float()[..., None] * inv_freq  # [N, T, dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, heads, head_dim]; cos, sin [N, T, rot]. Rotates x[..., :rot] by halves."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, scale: float) -> torch.Tensor:
    """Append the new keys/values of each sequence to its cache slot, then attend over the slot.

    q [N, T, nh, dk]; k [N, T, nkv, dk]; v [N, T, nkv, dv]; caches [n_slots, max_len, nkv, d];
    slots [N] cache rows; start [N] tokens already cached per sequence (query t sits at start + t).
    Query head h reads kv head h // (nh / nkv). Returns [N, T, nh, dv].
    """
    N, T, nh, dk = q.shape
    nkv, dv = v.shape[2], v.shape[3]
    group = nh // nkv
    pos = start[:, None] + torch.arange(T, device=q.device)  # [N, T]
    k_cache[slots[:, None], pos] = k.to(k_cache.dtype)
    v_cache[slots[:, None], pos] = v.to(v_cache.dtype)
    if attention_op.kernel_applies(q, k_cache, v_cache):  # tiled, in C++: no mask or scores over the span
        return attention_op.attention_cached(q, k_cache, v_cache, slots, start, scale)
    span = int(start.max()) + T  # keys beyond the longest sequence are never visible
    if N == 1:  # one sequence (decode of a single stream): its cache row as a view, no gather
        row = int(slots[0])
        keys, values = k_cache[row:row + 1, :span].transpose(1, 2), v_cache[row:row + 1, :span].transpose(1, 2)
    else:
        keys = k_cache[slots, :span].transpose(1, 2)  # [N, nkv, S, dk]
        values = v_cache[slots, :span].transpose(1, 2)  # [N, nkv, S, dv]
    # Fold each kv head's query group into the query axis (row t * group + g) so the cache is read once per
    # kv head, and attend a block of queries at a time: SDPA widens a boolean mask to float32, which over a
    # whole 512-token chunk at a 2048-token span is 32 MB more peak memory.
    q = q.view(N, T, nkv, group, dk).transpose(1, 2)  # [N, nkv, T, group, dk]
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if N == 1 and T == 1:  # one token of one sequence sees its whole span: no mask
        o = F.scaled_dot_product_attention(q.reshape(N, nkv, group, dk), keys, values, scale=scale)
        return o.reshape(N, T, nh, dv)  # head h = kv head * group + g
    out = q.new_empty(N, T, nkv, group, dv)
    step = max(1, _ATTN_MASK_ELEMENTS // (group * span))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        visible = torch.arange(span, device=q.device) <= pos[:, t0:t1, None]  # [N, Tb, S]: causal, own slot
        mask = visible[:, None, :, None].expand(N, 1, t1 - t0, group, span).reshape(N, 1, -1, span)
        o = F.scaled_dot_product_attention(q[:, :, t0:t1].reshape(N, nkv, -1, dk), keys, values, attn_mask=mask,
                                           scale=scale)  # [N, nkv, Tb * group, dv]
        out[:, t0:t1] = o.view(N, nkv, t1 - t0, group, dv).transpose(1, 2)
    return out.view(N, T, nh, dv)


_ATTN_MASK_ELEMENTS = 1 << 20  # query rows x keys per SDPA call in cached_attention: a 4 MB float mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each row, nothing cached (training). q [N, T, nh, dk]; k [N, T, nkv, dk];
    v [N, T, nkv, dv]; query head h reads kv head h // (nh / nkv). Returns [N, T, nh, dv]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=scale)
    return o.transpose(1, 2)


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial rope, grouped KV and an output gate sigmoid(x W_g)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # rows: query (nh*hd) | gate (nh*hd) | key (nkv*hd) | value (nkv*hd)
        self.qkv_proj = Linear(hidden, (2 * num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                start: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, T, E]. With caches: continue the sequences in cache rows `slots` from position `start`;
        without: each row is a whole sequence and nothing is kept (training)."""
        N, T, _ = x.shape
        proj = self.qkv_proj(x)
        if k_cache is not None and 1 < T <= STEP_TOKENS and _fused_inference(proj, cos, self.q_norm.weight):
            # a few tokens (a verify pass): each as a decode step attends, so the pass gives a decode step's bits
            return self.o_proj(torch.cat([self._attend(proj[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], k_cache,
                                                       v_cache, slots, start + t) for t in range(T)], dim=1))
        return self.o_proj(self._attend(proj, cos, sin, k_cache, v_cache, slots, start))

    def _attend(self, proj, cos, sin, k_cache, v_cache, slots, start) -> torch.Tensor:
        """proj [N, T, D] (the q, gate, k, v projections) -> the gated attention output [N, T, nh hd]."""
        N, T, _ = proj.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if (T == 1 and k_cache is not None and _fused_inference(proj, cos, self.q_norm.weight)
                and k_cache.dtype in _STEP_CACHE_DTYPES and v_cache.dtype == k_cache.dtype and k_cache.is_cpu
                and not _split_decode(N * nkv, start)):
            # decode: norms, rope, cache write, attention and gate in one kernel call (~40 small ops otherwise)
            o = torch.empty(N, nh * hd)
            fused.extension().attention_step(proj.view(N, -1), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                             cos.reshape(N, -1).contiguous(), sin.reshape(N, -1).contiguous(),
                                             k_cache, v_cache, slots, start, hd ** -0.5, o)
            return o.view(N, 1, nh * hd)
        proj = proj if proj.is_contiguous() else proj.contiguous()  # (a verify pass's token: rows T apart)
        q, gate, k, v = proj.split([nh * hd, nh * hd, nkv * hd, nkv * hd], dim=-1)
        inference = _fused_inference(proj, cos, self.q_norm.weight)
        if inference:  # norms and rope in place on the projection: no [T, heads, hd] temporaries
            fused.extension().norm_rope_rows(proj.view(N * T, -1), self.q_norm.weight, self.k_norm.weight,
                                             self.q_norm.eps, cos.reshape(N * T, -1).contiguous(),
                                             sin.reshape(N * T, -1).contiguous(), nh, nkv, 2 * nh * hd)
            q, k = q.view(N, T, nh, hd), k.view(N, T, nkv, hd)
        else:
            q = apply_rotary(self.q_norm(q.view(N, T, nh, hd)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(N, T, nkv, hd)), cos, sin)
        if k_cache is None:
            o = causal_attention(q, k, v.view(N, T, nkv, hd), hd ** -0.5)
        else:
            o = cached_attention(q, k, v.view(N, T, nkv, hd), k_cache, v_cache, slots, start, hd ** -0.5)
        o = o.reshape(N, T, nh * hd)
        return o.mul_(gate.sigmoid_()) if inference else o * torch.sigmoid(gate)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused as one [2I, hidden] matrix."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate, bias=False)
        self.down = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), inplace=True))  # over the gate half: 7 MB less at 512 tokens


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax over experts in float32, keep the k largest (renormalised to sum 1 if asked).
    logits [M, n_experts] -> weights [M, k] float32, expert ids [M, k]."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def part(weight: torch.Tensor, index) -> torch.Tensor:
    """weight[index] in the same form: a Q8_0 matrix's part keeps its scales (an expert of stacked
    matrices, a block of rows); packed stacked matrices give their matrix `index` (an expert)."""
    if packed.is_packed(weight):
        return packed.part(weight, index)
    w = weight[index]
    if weight.dtype == torch.int8:
        w.scale = weight.scale[index]
    return w


class Experts(nn.Module):
    """n SwiGLU experts as stacked matrices: gate_up [n, 2I, hidden] (gate rows first), down [n, hidden, I].
    first: the router's number of the first (a tensor-parallel rank holds experts first .. first + n - 1, and
    leaves the tokens' assignments to the others out: their ranks add them)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0):
        super().__init__()
        self.first = first
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [M, hidden]; ids, weights [M, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x) over the experts
        held, [M, hidden]. One token (a decode step) runs its experts in turn; more are grouped by expert."""
        return self._one_token(x, ids, weights) if ids.shape[0] == 1 else self._grouped(x, ids, weights)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, n = ids.shape[1], self.gate_up.shape[0]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert, tokens ascending (as plan.h takes them)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.first + n).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        begin = sum(counts[:self.first])  # the held experts' assignments follow those of lower numbers
        for e in range(n):
            count = counts[self.first + e]
            if count == 0:
                continue
            rows = tokens[begin:begin + count]
            y = linear(swiglu(linear(x[rows], part(self.gate_up, e))), part(self.down, e))
            out.index_add_(0, rows, y.float() * weights.flatten()[order[begin:begin + count], None])
            begin += count
        return out.to(x.dtype)


    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """_grouped's sums for one token, in its order (experts ascending), without its sorting and scatter."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        n = self.gate_up.shape[0]
        for e, w in sorted(zip(ids[0].tolist(), weights[0].unbind())):
            if self.first <= e < self.first + n:
                e -= self.first
                out += linear(swiglu(linear(x, part(self.gate_up, e))), part(self.down, e)).float() * w
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Softmax top-k routed experts plus an always-on shared expert scaled by sigmoid(x w_shared)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 shared_intermediate: int, normalize: bool):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.router = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared = MLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, hidden]
        weights, ids = softmax_topk(self.router(flat), self.top_k, self.normalize)
        out = self.experts(flat, ids, weights)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return out.view(x.shape)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool, scale: float,
                 n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of DeepSeek-V3 / Kimi: sigmoid scores; experts are chosen by score + bias (the bias only
    balances the load), among the topk_group groups whose two best biased scores sum highest, and
    weighted by their unbiased scores (renormalised if asked), times `scale`.
    logits [M, n_experts] -> weights [M, k] float32, expert ids [M, k]."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if topk_group < n_group:
        grouped = choice.view(choice.shape[0], n_group, -1)  # [M, groups, experts per group]
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices  # [M, topk_group]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class SigmoidMoE(nn.Module):
    """Sigmoid top-k routed experts (see sigmoid_topk) plus always-on shared experts without a gate.
    The router and its bias stay float32 (transformers keeps them so)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 normalize: bool, scale: float, n_group: int = 1, topk_group: int = 1):
        super().__init__()
        self.top_k, self.normalize, self.scale = top_k, normalize, scale
        self.n_group, self.topk_group = n_group, topk_group
        self.router = Linear(hidden, num_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(num_experts))
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared = MLP(hidden, shared_intermediate) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, hidden]
        logits = F.linear(flat.float(), self.router.weight.float())
        weights, ids = sigmoid_topk(logits, self.expert_bias, self.top_k, self.normalize, self.scale,
                                    self.n_group, self.topk_group)
        out = self.experts(flat, ids, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(x.shape)
