"""Tensor parallel: every rank holds every layer, a 1/N share of each by heads and columns.

Gated DeltaNet layers split by groups of key heads with their value heads (rank n: key heads n*H/N ..,
value heads n*HV/N ..; their conv channels, decay and step size follow), attention by KV-head groups with
their query heads, MLPs by intermediate columns, the embedding and the head by vocabulary rows. Each rank's
output projections (out_proj, o_proj, down) give a partial sum: one all-reduce after each mixer and each
MLP makes it whole, and the embedding's rows (zero on the ranks that do not hold a token) are summed the
same way. The state splits with the heads. Every rank runs the same pass on the same tokens (rank 0
broadcasts them); rank 0 gathers the head's vocabulary shards.

So far for dense Qwen3.5 (qwen35) in float files: MoE layers and Kimi's layers are not split yet, and
quantised blocks are not sliced.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.distributed as dist
from torch import nn

from deltaserve.dist import group
from deltaserve.dist.spread import SpreadModel, SpreadState, work
from deltaserve.errors import DeltaserveError
from deltaserve.models.base import HybridModel
from deltaserve.models.common import dense, lm_logits
from deltaserve.models.layers import embed_tokens
from deltaserve.models.state import HybridState, Snapshots


class TensorPart:
    """models.common.build's `part` for rank `rank` of `world_size`: the model of 1/N-sized heads and
    columns, and each parameter's share of the file's tensor."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.full = None  # the checkpoint's config, set by cut

    def cut(self, model: HybridModel) -> HybridModel:
        cfg, N = model.config, self.world_size
        if getattr(cfg, "arch", None) != "qwen35" or "moe" in cfg.ffn_types:
            raise DeltaserveError(f"--tp splits dense Qwen3.5 (qwen35) models so far, not "
                                  f"{getattr(cfg, 'arch', type(model).__name__)}: use --pp")
        sizes = dict(linear_k_heads=cfg.linear_k_heads, linear_v_heads=cfg.linear_v_heads, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size)
        odd = [f"{k} {v}" for k, v in sizes.items() if v % N]
        if odd:
            raise DeltaserveError(f"--tp {N} must divide the model's head counts and MLP width: {', '.join(odd)}")
        self.full = cfg
        small = dataclasses.replace(cfg, **{k: v // N for k, v in sizes.items()},
                                    vocab_size=math.ceil(cfg.vocab_size / N))
        with torch.device("meta"):
            return type(model)(small, compute_dtype=model.compute_dtype,
                               cache_dtype=model.cache_dtype).requires_grad_(False)

    def shard(self, name: str, t) -> torch.Tensor:
        """This rank's share of parameter `name` (t: the whole, float32 or Rows). Row shares are sliced from
        Rows, so only this rank's rows are read and widened (not a whole 248k-row embedding in float32)."""
        cfg, n, N = self.full, self.rank, self.world_size
        if name in ("embed.weight", "lm_head.weight"):
            per = math.ceil(cfg.vocab_size / N)
            rows = t[n * per:min((n + 1) * per, cfg.vocab_size)]
            pad = rows.new_zeros(per - rows.shape[0], rows.shape[1])  # the last rank's rows past the vocabulary
            return torch.cat([rows, pad]) if pad.shape[0] else rows
        m = re.fullmatch(r"layers\.\d+\.(.+)", name)
        rest = m.group(1) if m else ""
        qk, v = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_v_heads * cfg.linear_v_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        split_rows = {"mixer.in_proj.weight": [qk, qk, v, v, cfg.linear_v_heads, cfg.linear_v_heads],
                      "mixer.conv_weight": [qk, qk, v], "mixer.dt_bias": [cfg.linear_v_heads],
                      "mixer.A": [cfg.linear_v_heads], "mixer.qkv_proj.weight": [q, q, kv, kv],
                      "ffn.gate_up.weight": [cfg.intermediate_size] * 2}
        if rest in split_rows:  # each block of rows (q | k | v | ...) gives this rank its share
            starts = [sum(split_rows[rest][:i]) for i in range(len(split_rows[rest]))]
            return torch.cat([t[s + n * size // N:s + (n + 1) * size // N]
                              for s, size in zip(starts, split_rows[rest])])
        if rest in ("mixer.out_proj.weight", "mixer.o_proj.weight", "ffn.down.weight"):
            return dense(t).chunk(N, dim=1)[n]
        return dense(t)  # norms: every rank needs them whole


class Summed(nn.Module):
    """A mixer or an MLP whose output (the first of a tuple) is summed over the ranks in place."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        dist.all_reduce(out[0] if isinstance(out, tuple) else out)
        return out


def sum_outputs(model: HybridModel) -> None:
    """After loading: one all-reduce after each output projection (mixers and MLPs)."""
    for layer in model.layers:
        layer.mixer, layer.ffn = Summed(layer.mixer), Summed(layer.ffn)


def tp_forward(model: HybridModel, part: TensorPart, ids: torch.Tensor, state: HybridState, slots: torch.Tensor,
               logits: str, snapshots: int) -> torch.Tensor:
    """This rank's share of HybridModel.forward: the same bookkeeping, whole hidden states on every rank,
    and this rank's vocabulary shard of the logits [N, V/N] (or [N, T, V/N])."""
    with torch.inference_mode():
        start = state.lengths[slots]  # [N]
        N, T = ids.shape
        n = len(model.layers)
        snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * n, [None] * n) \
            if snapshots else None
        rope = model.rope(start[:, None] + torch.arange(T))
        per = model.config.vocab_size
        local = ids - part.rank * per
        mine = (local >= 0) & (local < per)
        h = embed_tokens(model.embed.weight, local.clamp(0, per - 1), model.compute_dtype) * mine[..., None]
        dist.all_reduce(h)
        h = model.run_layers(h, rope, state, slots, start, snaps, range(n))
        state.lengths[slots] = start + T
        state.snapshots = snaps
        return lm_logits(model, model.norm(h[:, -1] if logits == "last" else h))


class TensorModel(SpreadModel):
    def __init__(self, inner: HybridModel, part: TensorPart, link: group.Link):
        super().__init__(inner, link, part.world_size, config=part.full)
        self.part = part

    def held(self, rank: int) -> range:
        return range(len(self.inner.layers))

    def local_state(self, n_slots: int, max_len: int) -> HybridState:
        return self.inner.new_state(n_slots, max_len)

    def forward(self, input_ids: torch.Tensor, state: SpreadState, slots=None, logits: str = "last",
                snapshots: int = 0) -> torch.Tensor:
        with torch.inference_mode():
            input_ids, slots = self.checked(input_ids, state, slots, logits)
            with self.link.command("forward", input_ids.tolist(), slots.tolist(), logits, snapshots):
                mine = tp_forward(self.inner, self.part, input_ids, state.local, slots, logits, snapshots)
                shards = [torch.empty_like(mine) for _ in range(self.world_size)]
                dist.gather(mine, shards, dst=0)
                self.link.bytes_received += sum(s.numel() * s.element_size() for s in shards[1:])
            return torch.cat(shards, dim=-1)[..., :self.config.vocab_size]


def work_shard(model: HybridModel, part: TensorPart, timeout_s: float) -> None:
    """A worker rank of tensor parallel: its share of every command until rank 0 stops."""

    def forward(state: HybridState, ids: list[list[int]], slots: list[int], logits: str, snapshots: int) -> None:
        mine = tp_forward(model, part, torch.tensor(ids, dtype=torch.long), state,
                          torch.tensor(slots, dtype=torch.long), logits, snapshots)
        dist.gather(mine, dst=0)

    work(model, model.new_state, forward, part.rank, timeout_s)
