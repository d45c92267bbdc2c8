"""The multi-token-prediction (MTP) layer that Qwen3.5 and Qwen3-Next checkpoints ship (DeepSeek-V3's design).

Entry p of the layer reads the embedding of token p and the trunk's final-normed hidden state after token
p-1 (zeros before token 0, as llama.cpp feeds it), and predicts token p+1, as the trunk's own output at p does:

    g_p = norm(layer(fc([enorm(embed(x_p)) | hnorm(h_{p-1})])))        logits_p = lm_head(g_p)

`layer` is a full-attention decoder layer with its own KV cache, at the trunk's positions; the embedding and
the output head are the trunk's. Drafting chains it: g_p stands for h_p in the next entry, with the drafted
token (vLLM's qwen3_next_mtp.py and llama.cpp's qwen35.cpp feed the same normed vector on).

In a HybridState the layer is one more entry after the trunk's layers: its KV cache in k / v, and h_{L-1},
the trunk's hidden state after the slot's last token, as its "conv" state [n_slots, 1, E] (a tape of width
one over h). Every state operation (reset, rollback from snapshots, prefix checkpoints, persistence) then
keeps the MTP layer in step with the trunk without knowing of it: `follow` extends it after every trunk
pass over the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.errors import DeltaserveError
from deltaserve.loader.memory import lazy_zeros, weight_empty
from deltaserve.loader.quants import quantize_q8_0
from deltaserve.models.common import lm_logits
from deltaserve.models.layers import Q8_BLOCK, Linear, RMSNorm
from deltaserve.models.state import HybridState, Snapshots

# Where a family drafts in one C++ call (models/qwen/plan.py), its float (F16 / BF16 / F32) MTP weights and output
# head are read through Q8_0 copies (rounded as ggml's quantiser does, activations rounded per 32 as on Q8_0 files)
# made at the first draft: a draft step reads half the bytes, and drafts are only guesses that the trunk's own
# weights verify, so the output is unchanged. The copies cost about half those weights' float16 size in memory
# (for a tied head, half the embedding). False: the plan reads the weights as stored, as the modules do.
DRAFT_Q8 = True


def q8_0_copy(w: torch.Tensor, rows_per_pass: int = 4096) -> torch.Tensor:
    """A Q8_0 copy of a float weight w [N, K] (K a multiple of 32), rounded as ggml's quantiser rounds it (loader
    quantize_q8_0): int8 [N, K] carrying `.scale`, float16 [N, K / 32], in the form linear() reads. Unlike
    layers.quantize_q8 it changes the values: for weights whose output is only a guess (DRAFT_Q8)."""
    N, K = w.shape
    q = weight_empty((N, K), torch.int8)
    scale = weight_empty((N, K // Q8_BLOCK), torch.float16)  # 2 MB pages, as layers.quantize_q8's
    for r in range(0, N, rows_per_pass):  # in slices: the float32 temporaries stay small beside a large head
        blocks = quantize_q8_0(w[r:r + rows_per_pass]).view(-1, K // Q8_BLOCK, 2 + Q8_BLOCK)  # d f16 | q int8[32]
        scale[r:r + rows_per_pass] = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        q[r:r + rows_per_pass] = blocks[..., 2:].contiguous().view(torch.int8).reshape(-1, K)
    q.scale = scale
    return q


class MTPHead(nn.Module):
    """enorm / hnorm over [embedding | hidden], fc [E, 2E], one decoder layer, norm. `layer` is the family's
    decoder layer (input_norm, mixer, post_norm, ffn), called through the model's `attend`."""

    def __init__(self, hidden: int, eps: float, layer: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.norm = RMSNorm(hidden, eps)

    def forward(self, model, ids: torch.Tensor, hidden: torch.Tensor, rope, k_cache=None, v_cache=None, slots=None,
                start=None, kv_only: bool = False) -> torch.Tensor | None:
        """ids [N, T]; hidden [N, T, E] the normed hidden state before each token -> g [N, T, E]. With caches
        the entries continue cache rows `slots` from `start`; kv_only: only write them (the trunk's pass is
        followed, nothing is predicted), skipping the feed-forward half."""
        e = self.enorm(model.embed(ids, model.compute_dtype))
        x = self.fc(torch.cat([e, self.hnorm(hidden).to(e.dtype)], dim=-1))
        layer = self.layer
        x = x + model.attend(layer, layer.input_norm(x), rope, k_cache, v_cache, slots, start)
        if kv_only:
            return None
        x = x + layer.ffn(layer.post_norm(x))
        return self.norm(x)


def with_mtp(model, state: HybridState) -> HybridState:
    """`state` with the MTP layer's entry appended: a KV cache like the trunk's attention layers' and the
    trunk's last hidden state per slot (zeros: before token 0)."""
    if getattr(model, "mtp", None) is None:
        raise DeltaserveError(f"{type(model).__name__} has no MTP layer: its checkpoint carries none "
                              "(mtp.* tensors, or GGUF blk.N.nextn.* after the trunk)")
    sizes, n, max_len = model.state_sizes(), state.n_slots, state.max_len
    cpu = state.lengths.device.type == "cpu"

    def zeros(*shape, dtype):
        return lazy_zeros(shape, dtype) if cpu else torch.zeros(shape, dtype=dtype, device=state.lengths.device)

    kv_dtype = model.cache_dtype or model.compute_dtype
    state.conv.append(zeros(n, 1, model.config.hidden_size, dtype=model.compute_dtype))
    state.ssm.append(None)
    state.k.append(zeros(n, max_len, *sizes["k"], dtype=kv_dtype))
    state.v.append(zeros(n, max_len, *sizes["v"], dtype=kv_dtype))
    return state


def has_mtp(model, state: HybridState | None) -> bool:
    """Whether `state` carries the MTP layer's entry (see with_mtp)."""
    return state is not None and len(state.conv) > len(model.layers)


def follow(model, ids: torch.Tensor, h: torch.Tensor, rope, state: HybridState, slots: torch.Tensor,
           start: torch.Tensor, snaps: Snapshots | None) -> None:
    """After a trunk pass over ids [N, T] at positions start.. that gave normed hidden states h [N, T, E]: the
    MTP layer's entries for the same positions, and the slots' last hidden state. snaps: the pass keeps
    snapshots, and the hidden state after each token is one (the tape [before | h], as a conv tape)."""
    i = len(model.layers)
    tape = torch.cat([state.conv[i][slots].to(h.dtype), h], dim=1)  # [N, 1+T, E]
    if not model.mtp_follow(ids, tape[:, :-1], rope, state.k[i], state.v[i], slots, start):
        model.mtp(model, ids, tape[:, :-1], rope, state.k[i], state.v[i], slots, start, kv_only=True)
    state.conv[i][slots] = h[:, -1:].to(state.conv[i].dtype)
    if snaps is not None:
        snaps.conv[i] = tape


def draft_step(model, state: HybridState, slots: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
               offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chained step of drafting: the entries of tokens ids [N, 1] after hidden [N, 1, E], at offset past
    each slot's length (0: the token that follows the slot's last one). Writes the MTP KV cache there (the
    verifying pass writes those rows again) and leaves the trunk alone. -> logits [N, V], g [N, 1, E]."""
    with torch.inference_mode():
        i = len(model.layers)
        start = state.lengths[slots] + offset
        g = model.mtp(model, ids.to(model.embed.weight.device), hidden, model.rope(start[:, None]), state.k[i],
                      state.v[i], slots, start)
        return lm_logits(model, g[:, -1]), g


def draft(model, state: HybridState, slots: torch.Tensor, ids: torch.Tensor, ks: list[int]) -> list[list[int]]:
    """Greedy chained drafts: ks[n] tokens to follow ids [N] (each slot's pending token, the one after its last
    cached token), the first from the trunk's hidden state after that token, each next from the layer's own
    output and the token it just drafted. Writes the MTP cache at the drafted positions (the verifying pass
    writes those rows again). One call where the family has one, else a draft_step per step."""
    with torch.inference_mode():
        hidden = state.conv[len(model.layers)][slots]  # [N, 1, E]
        fast = model.mtp_draft(state, slots, ids, hidden[:, 0], ks)
        if fast is not None:
            return fast
        tokens = ids[:, None].clone()  # [N, 1]
        drafts: list[list[int]] = [[] for _ in ks]
        for step in range(max(ks, default=0)):
            live = torch.tensor([i for i, k in enumerate(ks) if k > step], dtype=torch.long)
            logits, g = draft_step(model, state, slots[live], tokens[live], hidden[live], step)
            best = logits.argmax(-1)
            tokens[live, 0], hidden[live] = best.to(tokens.device), g.to(hidden.dtype)
            for i, token in zip(live.tolist(), best.tolist()):
                drafts[i].append(token)
        return drafts


def sequence_logits(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Without a state (training, checks): the trunk's logits [N, T, V] and the MTP layer's [N, T, V] over
    whole sequences, each row from an empty state; row p of both predicts token p+1. Gradients flow."""
    if getattr(model, "mtp", None) is None:
        raise DeltaserveError(f"{type(model).__name__} has no MTP layer")
    N, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(N, T)
    h = model(input_ids, logits="hidden")  # [N, T, E] normed
    before = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    g = model.mtp(model, input_ids, before, model.rope(positions))
    return lm_logits(model, h), lm_logits(model, g)
