"""Random-weight models for tests and benchmarks, written the way a released model would be.

Weights are drawn in Hugging Face names and layout (the checkpoint that transformers'
Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM or Qwen3NextForCausalLM loads), rounded to bfloat16
like a released checkpoint, then converted to GGUF with the transforms of llama.cpp's
convert_hf_to_gguf.py (conversion/qwen.py, conversion/base.py), checked against what
src/models/qwen35.cpp, qwen35moe.cpp and qwen3next.cpp require when they load:

- `ssm_a = -exp(A_log)`; `dt_bias` is stored as `ssm_dt.bias`; conv1d [C, 1, K] is squeezed to [C, K].
- every `*norm.weight` except the gated-delta-net output norm (`linear_attn.norm`) is stored +1:
  Hugging Face keeps those RMSNorm weights zero-centred.
- qwen35/qwen35moe: value heads go from grouped order (value head j reads key head j // r) to tiled
  order (j % H) in attn_qkv's V rows, attn_gate, ssm_beta/ssm_alpha, ssm_a, ssm_dt.bias, the conv's
  V channels and ssm_out's columns. qwen3next keeps grouped order (llama.cpp repeats q/k per group).
- qwen3next: the per-key-head interleaved in_proj_qkvz [q | k | v | z] becomes attn_qkv
  [all q | all k | all v] plus attn_gate [all z]; in_proj_ba is stored as ssm_ba unchanged.
- experts are stacked into ffn_{gate,up,down}_exps; 1-D tensors, norms, the routers and the conv
  stay float32; a matrix whose rows do not split into q8_0 blocks falls back to float16.
- kimi-linear (conversion/kimi_linear.py, src/models/kimi-linear.cpp) is drawn in Moonshot's release
  layout; its transforms are listed on `KimiLinear`.

An architecture is one `ArchMaker` in `ARCHES`: its presets, Hugging Face config, random tensors
(one layer at a time) and conversion. Both files are streamed so the 0.8b presets fit in memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType, MODEL_TENSOR

from deltaserve.errors import DeltaserveError
from deltaserve.tokenizer import Tokenizer, train_bpe

DTYPES = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
PRESETS = ("tiny", "small", "0.8b")  # each architecture has some of these
EMBEDDING_STD = 0.02

# The converter keeps these matrices float32 whatever the file type (ModelBase.prepare_tensors).
_ALWAYS_F32 = {gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") + ".weight"
               for t in (MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_GATE_INP_SHEXP, MODEL_TENSOR.SSM_CONV1D,
                         MODEL_TENSOR.SSM_CONV1D_Q, MODEL_TENSOR.SSM_CONV1D_K, MODEL_TENSOR.SSM_CONV1D_V)}

Group = dict[str, torch.Tensor]  # Hugging Face name -> bfloat16 tensor, one layer's worth


# -- shapes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HybridShape:
    """Hyper-parameters of a Qwen hybrid (gated delta net + gated attention) model.

    llama.cpp sizes qwen35/qwen3next value heads by `ssm.state_size` (the key head size), so one
    `gdn_head_dim` serves keys and values. `vocab=None` means the tokenizer's size.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_key_heads: int                # H
    gdn_value_heads: int              # HV, a multiple of H
    gdn_head_dim: int                 # K == V
    vocab: int | None = None
    intermediate: int = 0             # dense FFN size; qwen3next writes it although every layer is MoE
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    tied_embeddings: bool = True
    conv_kernel: int = 4
    full_attention_interval: int = 4  # layer i is full attention when (i + 1) % interval == 0
    rotary_factor: float = 0.25
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    max_positions: int = 262144

    def __post_init__(self):
        sizes = {k: getattr(self, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "gdn_key_heads",
                                               "gdn_value_heads", "gdn_head_dim", "conv_kernel",
                                               "full_attention_interval")}
        if bad := [f"{k}={v}" for k, v in sizes.items() if v < 1]:
            raise DeltaserveError(f"model shape: {', '.join(bad)} must be positive")
        if self.gdn_value_heads % self.gdn_key_heads:
            raise DeltaserveError(f"model shape: gdn_value_heads={self.gdn_value_heads} is not a multiple "
                                  f"of gdn_key_heads={self.gdn_key_heads}")
        if self.heads % self.kv_heads:
            raise DeltaserveError(f"model shape: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.rope_dims < 2 or self.rope_dims % 2:
            raise DeltaserveError(f"model shape: head_dim={self.head_dim} x rotary_factor={self.rotary_factor} "
                                  f"gives {self.rope_dims} rotary dims, not a positive even number")
        if self.experts and not (0 < self.experts_used <= self.experts and self.expert_ffn > 0
                                 and self.shared_expert_ffn > 0):
            raise DeltaserveError(f"model shape: experts={self.experts} needs 0 < experts_used <= experts and "
                                  f"positive expert_ffn / shared_expert_ffn (got {self.experts_used}, "
                                  f"{self.expert_ffn}, {self.shared_expert_ffn})")

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.rotary_factor)

    @property
    def mrope_sections(self) -> list[int]:
        """Rotary pairs split over (time, height, width) like Qwen's [11, 11, 10] for 32 pairs."""
        base, rest = divmod(self.rope_dims // 2, 3)
        return [base + (rest > 0), base + (rest > 1), base]

    @property
    def key_dim(self) -> int:
        return self.gdn_key_heads * self.gdn_head_dim

    @property
    def value_dim(self) -> int:
        return self.gdn_value_heads * self.gdn_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


# -- random Hugging Face tensors -------------------------------------------------------------------

class Draw:
    """Seeded random tensors, rounded to bfloat16 like a released checkpoint."""

    def __init__(self, seed: int):
        self._gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float | None = None, mean: float = 0.0) -> torch.Tensor:
        """N(mean, std^2); std defaults to fan_in^-0.5 (the last dim): 0.017-0.031 for Qwen3.5-0.8B's
        sizes, and at any size activations stay O(1), so the layers outweigh the embedding as in a
        trained model."""
        x = torch.randn(shape, generator=self._gen)
        x.mul_(shape[-1] ** -0.5 if std is None else std).add_(mean)
        return x.to(torch.bfloat16)

    def uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        """U(low, high) in float32 (callers transform, then round)."""
        return torch.empty(n).uniform_(low, high, generator=self._gen)

    def centred_norm(self, n: int) -> torch.Tensor:
        """A zero-centred RMSNorm weight (the layer multiplies by 1 + w): near neutral, not exactly."""
        return self.normal(n, std=0.05)


def _only_tokens(rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Zero the rows of placeholder tokens: their logits stay 0 and never win over real ones."""
    rows[n_tokens:] = 0
    return rows


# -- the architecture interface -------------------------------------------------------------------

class ArchMaker(Protocol):
    """One architecture. A preset is a frozen dataclass with at least `vocab` (None: the tokenizer's
    size) and `layers`; HybridShape is the Qwen one."""

    gguf_arch: str
    presets: dict[str, Any]

    def hf_config(self, shape, tokenizer: Tokenizer) -> dict: ...

    def hf_tensors(self, shape, draw: Draw, n_tokens: int) -> Iterator[Group]:
        """Random Hugging Face tensors: the embedding, then one group per layer, then the head.
        Embedding and output rows from `n_tokens` on (placeholder tokens) are zero."""

    def to_gguf(self, shape, group: Group) -> Iterator[tuple[str, torch.Tensor]]:
        """GGUF (name, float32 tensor) pairs the converter makes from one group."""

    def gguf_metadata(self, writer: gguf.GGUFWriter, shape) -> None: ...


@dataclass(frozen=True)
class QwenHybrid:
    """qwen35 / qwen35moe / qwen3next: what differs between the three is in these fields."""

    gguf_arch: str
    hf_model_type: str
    hf_class: str
    presets: dict[str, HybridShape]
    moe: bool = False
    split_qkvz: bool = False        # qwen3next's interleaved in_proj_qkvz / in_proj_ba
    tiled_value_heads: bool = True  # the converter reorders value heads for ggml's tiled broadcast
    mrope: bool = True              # rope.dimension_sections (interleaved M-RoPE)
    fused_experts: bool = True      # experts as 3-D gate_up_proj / down_proj, else one module each
    hf_extra: dict = field(default_factory=dict)

    # Hugging Face side

    def hf_config(self, s: HybridShape, tokenizer: Tokenizer) -> dict:
        rope = {"rope_type": "default", "rope_theta": s.rope_theta, "partial_rotary_factor": s.rotary_factor}
        if self.mrope:
            rope |= {"mrope_section": s.mrope_sections, "mrope_interleaved": True}
        config = {
            "architectures": [self.hf_class], "model_type": self.hf_model_type,
            "vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "hidden_act": "silu", "max_position_embeddings": s.max_positions, "rms_norm_eps": s.rms_eps,
            "tie_word_embeddings": s.tied_embeddings, "attention_bias": False, "rope_parameters": rope,
            "full_attention_interval": s.full_attention_interval,
            "layer_types": ["linear_attention" if s.is_recurrent(i) else "full_attention" for i in range(s.layers)],
            "linear_conv_kernel_dim": s.conv_kernel, "linear_key_head_dim": s.gdn_head_dim,
            "linear_value_head_dim": s.gdn_head_dim, "linear_num_key_heads": s.gdn_key_heads,
            "linear_num_value_heads": s.gdn_value_heads,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "dtype": "bfloat16",
        }
        if s.intermediate:
            config["intermediate_size"] = s.intermediate
        if self.moe:
            config |= {"num_experts": s.experts, "num_experts_per_tok": s.experts_used,
                       "moe_intermediate_size": s.expert_ffn,
                       "shared_expert_intermediate_size": s.shared_expert_ffn}
        return config | self.hf_extra

    def hf_tensors(self, s: HybridShape, draw: Draw, n_tokens: int) -> Iterator[Group]:
        yield {"model.embed_tokens.weight": _only_tokens(draw.normal(s.vocab, s.hidden, std=EMBEDDING_STD), n_tokens)}
        for i in range(s.layers):
            p = f"model.layers.{i}."
            group = {p + "input_layernorm.weight": draw.centred_norm(s.hidden)}
            if s.is_recurrent(i):
                group |= self._gated_delta_net(s, draw, p + "linear_attn.")
            else:
                group |= self._attention(s, draw, p + "self_attn.")
            group[p + "post_attention_layernorm.weight"] = draw.centred_norm(s.hidden)
            if self.moe:
                group |= self._moe(s, draw, p + "mlp.")
            else:
                group |= self._mlp(draw, p + "mlp.", s.hidden, s.intermediate)
            yield group
        head = {"model.norm.weight": draw.centred_norm(s.hidden)}
        if not s.tied_embeddings:
            head["lm_head.weight"] = _only_tokens(draw.normal(s.vocab, s.hidden), n_tokens)
        yield head

    def _gated_delta_net(self, s: HybridShape, draw: Draw, p: str) -> Group:
        E, HV = s.hidden, s.gdn_value_heads
        if self.split_qkvz:  # per key head: [q (K) | k (K) | v (r*V) | z (r*V)], then [b (r) | a (r)]
            group = {p + "in_proj_qkvz.weight": draw.normal(2 * s.key_dim + 2 * s.value_dim, E),
                     p + "in_proj_ba.weight": draw.normal(2 * HV, E)}
        else:
            group = {p + "in_proj_qkv.weight": draw.normal(s.conv_dim, E),
                     p + "in_proj_z.weight": draw.normal(s.value_dim, E),
                     p + "in_proj_b.weight": draw.normal(HV, E),
                     p + "in_proj_a.weight": draw.normal(HV, E)}
        return group | {
            p + "conv1d.weight": draw.normal(s.conv_dim, 1, s.conv_kernel),  # depthwise: fan_in = kernel
            # dt = softplus(dt_bias) log-uniform in [1e-3, 0.1] (Mamba's time-step init), so decays
            # exp(-A dt) span 0.2..0.999 and heads remember; with dt ~ 1 every head forgets within a
            # token, its output hangs on one q.k product, and 0.1% weight noise moved logits by 10%.
            p + "dt_bias": draw.uniform(HV, math.log(1e-3), math.log(0.1)).exp().expm1().log().to(torch.bfloat16),
            p + "A_log": draw.uniform(HV, 1.0, 16.0).log().to(torch.bfloat16),
            p + "norm.weight": draw.normal(s.gdn_head_dim, std=0.05, mean=1.0),  # gated norm: w, not 1 + w
            p + "out_proj.weight": draw.normal(E, s.value_dim),
        }

    @staticmethod
    def _attention(s: HybridShape, draw: Draw, p: str) -> Group:
        E, D = s.hidden, s.head_dim
        return {
            p + "q_proj.weight": draw.normal(s.heads * D * 2, E),  # per head [query | output gate]
            p + "k_proj.weight": draw.normal(s.kv_heads * D, E),
            p + "v_proj.weight": draw.normal(s.kv_heads * D, E),
            p + "o_proj.weight": draw.normal(E, s.heads * D),
            p + "q_norm.weight": draw.centred_norm(D),
            p + "k_norm.weight": draw.centred_norm(D),
        }

    @staticmethod
    def _mlp(draw: Draw, p: str, hidden: int, ffn: int) -> Group:
        return {p + "gate_proj.weight": draw.normal(ffn, hidden),
                p + "up_proj.weight": draw.normal(ffn, hidden),
                p + "down_proj.weight": draw.normal(hidden, ffn)}

    def _moe(self, s: HybridShape, draw: Draw, p: str) -> Group:
        E, X, F = s.hidden, s.experts, s.expert_ffn
        group = {p + "gate.weight": draw.normal(X, E)}
        if self.fused_experts:
            group[p + "experts.gate_up_proj"] = draw.normal(X, 2 * F, E)  # [gate | up] rows
            group[p + "experts.down_proj"] = draw.normal(X, E, F)
        else:
            for j in range(X):
                group |= self._mlp(draw, f"{p}experts.{j}.", E, F)
        group |= self._mlp(draw, p + "shared_expert.", E, s.shared_expert_ffn)
        group[p + "shared_expert_gate.weight"] = draw.normal(1, E)
        return group

    # GGUF side

    def gguf_metadata(self, w: gguf.GGUFWriter, s: HybridShape) -> None:
        w.add_block_count(s.layers)
        w.add_context_length(s.max_positions)
        w.add_embedding_length(s.hidden)
        if s.intermediate:
            w.add_feed_forward_length(s.intermediate)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        if self.mrope:
            w.add_rope_dimension_sections([*s.mrope_sections, 0])
        w.add_rope_freq_base(s.rope_theta)
        w.add_layer_norm_rms_eps(s.rms_eps)
        if self.moe:
            w.add_expert_count(s.experts)
            w.add_expert_used_count(s.experts_used)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        if self.moe:
            w.add_expert_feed_forward_length(s.expert_ffn)
            w.add_expert_shared_feed_forward_length(s.shared_expert_ffn)
        w.add_ssm_conv_kernel(s.conv_kernel)
        w.add_ssm_state_size(s.gdn_head_dim)
        w.add_ssm_group_count(s.gdn_key_heads)
        w.add_ssm_time_step_rank(s.gdn_value_heads)
        w.add_ssm_inner_size(s.value_dim)
        w.add_full_attention_interval(s.full_attention_interval)
        w.add_rope_dimension_count(s.rope_dims)

    def to_gguf(self, s: HybridShape, group: Group) -> Iterator[tuple[str, torch.Tensor]]:
        names = _tensor_names(self.gguf_arch, s.layers)
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in group.items():
            t = t.float()  # the converter widens bfloat16 before any transform
            if m := re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name):
                experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
            elif name.endswith(".mlp.experts.gate_up_proj"):
                gate, up = t.chunk(2, dim=1)  # [X, 2F, E] -> two [X, F, E]
                base = name.removesuffix("gate_up_proj")
                yield names(base + "gate_proj.weight"), gate
                yield names(base + "up_proj.weight"), up
            elif name.endswith(".mlp.experts.down_proj"):
                yield names(name + ".weight"), t
            else:
                yield from self._convert(s, name, t, names)
        for name, by_id in experts.items():
            yield names(name), torch.stack([by_id[j] for j in range(len(by_id))])  # [X, rows, cols]

    def _convert(self, s: HybridShape, name: str, t: torch.Tensor,
                 names: Callable[[str], str]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.tiled_value_heads and ".linear_attn." in name and s.gdn_value_heads != s.gdn_key_heads:
            t = _tile_value_heads(s, name, t)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        elif name.endswith(".conv1d.weight"):
            t = t.reshape(s.conv_dim, s.conv_kernel)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith(".in_proj_qkvz.weight"):
            block = int(name.split(".")[2])
            qkv, z = _split_qkvz(s, t)
            yield _block_name(MODEL_TENSOR.ATTN_QKV, block), qkv
            yield _block_name(MODEL_TENSOR.ATTN_GATE, block), z
        else:
            yield names(name), t


@functools.lru_cache
def _tensor_names(arch: str, layers: int) -> Callable[[str], str]:
    """Hugging Face name -> GGUF name through gguf-py's table, the one the converter uses."""
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(arch_id, layers)

    def name_of(hf_name: str) -> str:
        if (gguf_name := table.get_name(hf_name, try_suffixes=(".weight", ".bias"))) is None:
            raise DeltaserveError(f"{arch}: gguf-py has no GGUF name for tensor '{hf_name}'")
        return gguf_name
    return name_of


def _block_name(tensor: MODEL_TENSOR, block: int) -> str:
    return gguf.TENSOR_NAMES[tensor].format(bid=block) + ".weight"


def _tiled(t: torch.Tensor, dim: int, groups: int, per_group: int, head_dim: int) -> torch.Tensor:
    """Reorder heads along `dim` from grouped [g0v0, g0v1, .., g1v0, ..] to tiled [g0v0, g1v0, .., g0v1, ..]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], groups, per_group, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _tile_value_heads(s: HybridShape, name: str, t: torch.Tensor) -> torch.Tensor:
    H, r, D, qk = s.gdn_key_heads, s.gdn_value_heads // s.gdn_key_heads, s.gdn_head_dim, 2 * s.key_dim
    if name.endswith(".in_proj_qkv.weight"):  # [2*H*K + HV*V, E]: only the V rows
        return torch.cat([t[:qk], _tiled(t[qk:], 0, H, r, D)])
    if name.endswith(".in_proj_z.weight"):
        return _tiled(t, 0, H, r, D)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return _tiled(t, 0, H, r, 1)
    if name.endswith(".conv1d.weight"):  # [C, 1, K] -> [C, K], V channels reordered
        t = t.reshape(s.conv_dim, s.conv_kernel)
        return torch.cat([t[:qk], _tiled(t[qk:], 0, H, r, D)])
    if name.endswith(".out_proj.weight"):  # [E, HV*V]: columns
        return _tiled(t, 1, H, r, D)
    return t  # linear_attn.norm is [V], shared by every head


def _split_qkvz(s: HybridShape, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H*(2K + 2rV), E] interleaved per key head -> attn_qkv [2*H*K + HV*V, E], attn_gate [HV*V, E]."""
    K, rV = s.gdn_head_dim, s.value_dim // s.gdn_key_heads
    q, k, v, z = t.reshape(s.gdn_key_heads, 2 * K + 2 * rV, -1).split([K, K, rV, rV], dim=1)
    flat = [x.reshape(-1, t.shape[1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


# -- Kimi Linear -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KimiShape:
    """Hyper-parameters of a Kimi Linear model (KDA + rope-less MLA, sigmoid-routed MoE).

    llama.cpp's kimi-linear sizes KDA and MLA layers by one `attention.head_count`, so `heads` serves
    both. Layer i is MLA when (i + 1) % full_attention_interval == 0 (Kimi-Linear-48B: 4, 8, .., 1-based),
    the first `dense_layers` layers have a dense MLP and the rest the MoE. `vocab=None`: the tokenizer's size.
    """

    hidden: int
    layers: int
    heads: int
    kda_head_dim: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int
    experts: int
    experts_used: int
    expert_ffn: int
    shared_experts: int = 1
    dense_layers: int = 1
    routed_scaling_factor: float = 2.446
    vocab: int | None = None
    tied_embeddings: bool = False
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rms_eps: float = 1e-5
    max_positions: int = 1048576

    def __post_init__(self):
        sizes = {k: getattr(self, k) for k in ("hidden", "layers", "heads", "kda_head_dim", "kv_lora_rank",
                                               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate",
                                               "experts", "expert_ffn", "conv_kernel", "full_attention_interval")}
        if bad := [f"{k}={v}" for k, v in sizes.items() if v < 1]:
            raise DeltaserveError(f"model shape: {', '.join(bad)} must be positive")
        if not 0 < self.experts_used <= self.experts:
            raise DeltaserveError(f"model shape: experts_used={self.experts_used} must be in [1, {self.experts}]")
        if not 0 <= self.dense_layers < self.layers:
            raise DeltaserveError(f"model shape: dense_layers={self.dense_layers} must be in [0, {self.layers})")

    @property
    def kda_dim(self) -> int:
        return self.heads * self.kda_head_dim

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


@dataclass(frozen=True)
class KimiLinear:
    """kimi-linear, drawn in Moonshot's release layout (Kimi-Linear-48B-A3B-Instruct: config.json with
    linear_attn_config, q/k/v_conv1d, block_sparse_moe.experts.{j}.w1/w2/w3) and converted like
    conversion/kimi_linear.py: A_log -> ssm_a = -exp(A_log), dt_bias -> ssm_dt.bias, convs [C, 1, W] ->
    [1, C, 1, W], kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, MLA as one kv head."""

    gguf_arch: str = "kimi-linear"
    hf_model_type: str = "kimi_linear"
    hf_class: str = "KimiLinearForCausalLM"
    presets: dict[str, KimiShape] = field(default_factory=dict)

    def hf_config(self, s: KimiShape, tokenizer: Tokenizer) -> dict:
        layers = range(1, s.layers + 1)  # Moonshot numbers layers from 1 here
        return {
            "architectures": [self.hf_class], "model_type": self.hf_model_type,
            "vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
            "intermediate_size": s.intermediate, "moe_intermediate_size": s.expert_ffn,
            "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "hidden_act": "silu",
            "kv_lora_rank": s.kv_lora_rank, "q_lora_rank": None, "qk_nope_head_dim": s.qk_nope_head_dim,
            "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim, "mla_use_nope": True,
            "num_experts": s.experts, "num_experts_per_token": s.experts_used,
            "num_shared_experts": s.shared_experts, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": s.routed_scaling_factor, "first_k_dense_replace": s.dense_layers,
            "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "linear_attn_config": {
                "kda_layers": [i for i in layers if s.is_recurrent(i - 1)],
                "full_attn_layers": [i for i in layers if not s.is_recurrent(i - 1)],
                "head_dim": s.kda_head_dim, "num_heads": s.heads, "short_conv_kernel_size": s.conv_kernel,
            },
            "rms_norm_eps": s.rms_eps, "model_max_length": s.max_positions,
            "tie_word_embeddings": s.tied_embeddings, "attention_bias": False,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "dtype": "bfloat16",
        }

    def hf_tensors(self, s: KimiShape, draw: Draw, n_tokens: int) -> Iterator[Group]:
        yield {"model.embed_tokens.weight": _only_tokens(draw.normal(s.vocab, s.hidden, std=EMBEDDING_STD), n_tokens)}
        for i in range(s.layers):
            p = f"model.layers.{i}."
            group = {p + "input_layernorm.weight": draw.normal(s.hidden, std=0.05, mean=1.0)}  # plain multipliers
            group |= self._kda(s, draw, p + "self_attn.") if s.is_recurrent(i) else self._mla(s, draw, p + "self_attn.")
            group[p + "post_attention_layernorm.weight"] = draw.normal(s.hidden, std=0.05, mean=1.0)
            if i < s.dense_layers:
                group |= QwenHybrid._mlp(draw, p + "mlp.", s.hidden, s.intermediate)
            else:
                group |= self._moe(s, draw, p + "block_sparse_moe.")
            yield group
        head = {"model.norm.weight": draw.normal(s.hidden, std=0.05, mean=1.0)}
        if not s.tied_embeddings:
            head["lm_head.weight"] = _only_tokens(draw.normal(s.vocab, s.hidden), n_tokens)
        yield head

    @staticmethod
    def _kda(s: KimiShape, draw: Draw, p: str) -> Group:
        E, H, D, C = s.hidden, s.heads, s.kda_head_dim, s.kda_dim
        group = {p + f"{x}_proj.weight": draw.normal(C, E) for x in "qkv"}
        group |= {p + f"{x}_conv1d.weight": draw.normal(C, 1, s.conv_kernel) for x in "qkv"}
        return group | {
            # per channel, as for the Qwen gates: softplus(dt_bias) log-uniform in [1e-3, 0.1], A in [1, 16]
            p + "A_log": draw.uniform(H, 1.0, 16.0).log().reshape(1, 1, H, 1).to(torch.bfloat16),
            p + "dt_bias": draw.uniform(C, math.log(1e-3), math.log(0.1)).exp().expm1().log().to(torch.bfloat16),
            p + "f_a_proj.weight": draw.normal(D, E),
            p + "f_b_proj.weight": draw.normal(C, D),
            p + "b_proj.weight": draw.normal(H, E),
            p + "g_a_proj.weight": draw.normal(D, E),
            p + "g_b_proj.weight": draw.normal(C, D),
            p + "o_norm.weight": draw.normal(D, std=0.05, mean=1.0),
            p + "o_proj.weight": draw.normal(E, C),
        }

    @staticmethod
    def _mla(s: KimiShape, draw: Draw, p: str) -> Group:
        E, nh, R = s.hidden, s.heads, s.kv_lora_rank
        return {
            p + "q_proj.weight": draw.normal(nh * (s.qk_nope_head_dim + s.qk_rope_head_dim), E),
            p + "kv_a_proj_with_mqa.weight": draw.normal(R + s.qk_rope_head_dim, E),
            p + "kv_a_layernorm.weight": draw.normal(R, std=0.05, mean=1.0),
            p + "kv_b_proj.weight": draw.normal(nh * (s.qk_nope_head_dim + s.v_head_dim), R),  # per head [k | v]
            p + "o_proj.weight": draw.normal(E, nh * s.v_head_dim),
        }

    @staticmethod
    def _moe(s: KimiShape, draw: Draw, p: str) -> Group:
        E, F = s.hidden, s.expert_ffn
        group = {p + "gate.weight": draw.normal(s.experts, E),
                 # the load-balancing bias is of the size of the sigmoid scores, so it moves choices
                 p + "gate.e_score_correction_bias": draw.normal(s.experts, std=0.05).float()}
        for j in range(s.experts):
            group |= {f"{p}experts.{j}.w1.weight": draw.normal(F, E), f"{p}experts.{j}.w3.weight": draw.normal(F, E),
                      f"{p}experts.{j}.w2.weight": draw.normal(E, F)}
        return group | QwenHybrid._mlp(draw, p + "shared_experts.", E, F * s.shared_experts)

    def gguf_metadata(self, w: gguf.GGUFWriter, s: KimiShape) -> None:
        w.add_block_count(s.layers)
        w.add_context_length(s.max_positions)
        w.add_embedding_length(s.hidden)
        w.add_feed_forward_length(s.intermediate)
        w.add_head_count(s.heads)
        # 0 marks a KDA layer; the converter turns MLA into one kv head (MQA over the latent)
        w.add_head_count_kv([1 if not s.is_recurrent(i) else 0 for i in range(s.layers)])
        w.add_layer_norm_rms_eps(s.rms_eps)
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_vocab_size(s.vocab)
        w.add_ssm_conv_kernel(s.conv_kernel)
        w.add_kda_head_dim(s.kda_head_dim)
        w.add_kv_lora_rank(s.kv_lora_rank)
        w.add_rope_dimension_count(s.qk_rope_head_dim)
        w.add_key_length(s.kv_lora_rank + s.qk_rope_head_dim)
        w.add_key_length_mla(s.qk_nope_head_dim + s.qk_rope_head_dim)
        w.add_value_length_mla(s.v_head_dim)
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_expert_shared_count(s.shared_experts)
        w.add_leading_dense_block_count(s.dense_layers)
        w.add_expert_weights_scale(s.routed_scaling_factor)

    def to_gguf(self, s: KimiShape, group: Group) -> Iterator[tuple[str, torch.Tensor]]:
        names = _tensor_names(self.gguf_arch, s.layers)
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in group.items():
            t = t.float()
            if m := re.fullmatch(r"(.*)\.experts\.(\d+)\.(w\d)\.weight", name):
                experts.setdefault(f"{m[1]}.experts.{m[3]}.weight", {})[int(m[2])] = t
            elif name.endswith("_conv1d.weight"):  # [C, 1, W] -> ggml ne {W, 1, C, 1}
                yield names(name), t.reshape(1, t.shape[0], 1, t.shape[-1])
            elif name.endswith(".A_log"):
                yield names(name), -torch.exp(t)
            elif name.endswith(".dt_bias"):
                yield names(name.removesuffix("dt_bias") + "dt_proj.bias"), t
            elif name.endswith(".e_score_correction_bias"):
                yield names(name.removesuffix("_bias") + ".bias"), t
            elif name.endswith(".kv_b_proj.weight"):  # per head [k_nope | v] rows -> k_b^T {dn, R, nh}, v_b {R, dv, nh}
                k_b, v_b = t.view(s.heads, s.qk_nope_head_dim + s.v_head_dim, -1).split(
                    [s.qk_nope_head_dim, s.v_head_dim], dim=1)
                yield names(name.replace("kv_b_proj", "k_b_proj")), k_b.transpose(1, 2).contiguous()
                yield names(name.replace("kv_b_proj", "v_b_proj")), v_b.contiguous()
            else:
                yield names(name), t
        for name, by_id in experts.items():
            yield names(name), torch.stack([by_id[j] for j in range(len(by_id))])  # [X, rows, cols]


# Test sizes: 4 layers (3 KDA, then MLA), a dense first layer; 3 heads, MLA latent 64 with nope 32 /
# rope 32 / value 64, so every row splits into q8_0 blocks.
_KIMI_TINY = KimiShape(hidden=96, layers=4, heads=3, kda_head_dim=32, kv_lora_rank=64, qk_nope_head_dim=32,
                       qk_rope_head_dim=32, v_head_dim=64, intermediate=160, experts=8, experts_used=2, expert_ffn=64)
# ~90M parameters for benchmarks: 8 layers (6 KDA, 2 MLA), Kimi-Linear-48B's head sizes (KDA 128; MLA
# nope 128 / rope 64 / value 128 over a 512 latent), 16 experts of 256 with 4 used and one shared.
_KIMI_SMALL = KimiShape(hidden=512, layers=8, heads=4, kda_head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, intermediate=1536, experts=16, experts_used=4,
                        expert_ffn=256)


# -- the architectures -----------------------------------------------------------------------------

# Qwen3.5-0.8B's text model (Qwen/Qwen3.5-0.8B config.json): every 4th layer full attention.
_QWEN35_08B = HybridShape(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, gdn_key_heads=16,
                          gdn_value_heads=16, gdn_head_dim=128, vocab=248320, intermediate=3584)
# Test sizes: not powers of two, 3 key heads with 6 value heads so the head reorder is not its
# own inverse, 6 attention heads over 2 kv heads. Rows stay multiples of 32 so q8_0 applies.
_TINY = HybridShape(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=64, gdn_key_heads=3,
                    gdn_value_heads=6, gdn_head_dim=32, intermediate=160)
_TINY_MOE = replace(_TINY, intermediate=0, experts=6, experts_used=2, expert_ffn=64, shared_expert_ffn=160,
                    tied_embeddings=False)
# ~0.8B in total like Qwen3.5-0.8B: its trunk with 8 experts of 512 (2 used) and a shared one of 512.
_MOE_08B = replace(_QWEN35_08B, intermediate=0, experts=8, experts_used=2, expert_ffn=512, shared_expert_ffn=512)

ARCHES: dict[str, ArchMaker] = {
    "qwen35": QwenHybrid("qwen35", "qwen3_5_text", "Qwen3_5ForCausalLM",
                         presets={"tiny": _TINY, "0.8b": _QWEN35_08B}),
    "qwen35moe": QwenHybrid("qwen35moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe=True,
                            presets={"tiny": _TINY_MOE, "0.8b": _MOE_08B}),
    "qwen3next": QwenHybrid("qwen3next", "qwen3_next", "Qwen3NextForCausalLM", moe=True, split_qkvz=True,
                            tiled_value_heads=False, mrope=False, fused_experts=False,
                            hf_extra={"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
                            presets={"tiny": replace(_TINY_MOE, intermediate=160),
                                     "0.8b": replace(_MOE_08B, intermediate=3584, vocab=151936)}),
    "kimi-linear": KimiLinear(presets={"tiny": _KIMI_TINY, "small": _KIMI_SMALL}),
}


# -- tokenizer -------------------------------------------------------------------------------------

TOKENIZER_TEXT = """\
The river starts as a thin line of water high in the hills. In spring the snow melts, and the
stream grows loud and quick; by summer it is slow again, warm enough for children to wade across
the stones. Farmers along the banks have watched it for hundreds of years. They say the water
remembers every field it has ever flooded, and they plant their orchards on the higher ground.

A good loaf of bread needs only flour, water, salt and time. Mix the dough, let it rest, fold it
twice, and leave it overnight in a cool room. In the morning the kitchen smells sour and sweet.
Bake it in a hot oven until the crust sings as it cools. Cut it only when it is no longer warm.

The old library opened at nine o'clock. Its windows faced east, so the reading room was bright in
the morning and quiet in the afternoon. Students came with notebooks and questions; retired
teachers came with newspapers. The librarian knew where every book was, even the ones that had
been shelved in the wrong place forty years ago.

When the train left the station, the city thinned into warehouses, then gardens, then open
country. A woman by the window counted the bridges: one, two, three, four. Somewhere after the
tenth she fell asleep, and she woke only when the conductor called the name of her town.

Numbers help us reason about the world: 3 apples and 4 pears make 7 pieces of fruit; 12 months
make a year; 60 minutes make an hour. Yet some questions have no number for an answer. Why do we
like music? What makes a joke funny? Where do ideas come from before we have them?

Weather changes quickly near the sea. A clear sky can fill with clouds within an hour, and the
wind can turn from the west to the north without warning. Fishermen read the colour of the water
and the shape of the waves, and they trust those signs more than any forecast.
"""


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """The small byte-level BPE tokenizer of every random model, learnt from TOKENIZER_TEXT."""
    return train_bpe(TOKENIZER_TEXT.split("\n\n"), vocab_size)


# -- writing ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MadeModel:
    gguf_path: Path
    hf_dir: Path | None
    arch: str
    shape: Any  # the preset, vocab filled in
    tokenizer: Tokenizer


def gguf_storage(name: str, t: torch.Tensor, want: QType) -> tuple[np.ndarray, QType]:
    """The converter's storage choice for one tensor (ModelBase.prepare_tensors), and the encoded data."""
    data = t.contiguous().numpy()
    qtype = want
    if (data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or re.sub(r"^blk\.\d+\.", "", name) in _ALWAYS_F32):
        qtype = QType.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows that do not split into blocks: the converter falls back to F16
        return gguf.quants.quantize(data, QType.F16), QType.F16


class _SafetensorsStream:
    """model.safetensors written one tensor at a time: the data goes to a side file until the
    header (which comes first in the file) is known, then both are joined."""

    _DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

    def __init__(self, path: Path):
        self.path, self._part = path, path.with_name(path.name + ".part")
        self._data = open(self._part, "wb+")
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self._header[name] = {"dtype": self._DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + raw.nbytes]}
        raw.tofile(self._data)
        self._offset += raw.nbytes

    def close(self) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        with open(self.path, "wb") as out:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            self._data.seek(0)
            shutil.copyfileobj(self._data, out, 16 << 20)
        self.abort()

    def abort(self) -> None:
        self._data.close()
        self._part.unlink(missing_ok=True)


def write_gguf(out_path: str | Path, arch: str, shape, tokenizer: Tokenizer, groups: Iterable[Group],
               dtype: str = "f16", name: str | None = None) -> Path:
    """Write Hugging Face tensors as the GGUF llama.cpp's converter makes of them: `groups` yields dicts of
    Hugging Face name -> tensor (one layer at a time keeps memory low; one dict holding everything works
    too), `shape` is the model's preset with `vocab` filled in, and the tokenizer is padded to that vocab.
    The file appears complete or not at all (it is written beside `out_path`, then renamed)."""
    if arch not in ARCHES:
        raise DeltaserveError(f"unknown architecture '{arch}' (known: {', '.join(ARCHES)})")
    if dtype not in DTYPES:
        raise DeltaserveError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    if shape.vocab is None or shape.vocab < tokenizer.vocab_size:
        raise DeltaserveError(f"{arch}: vocab {shape.vocab} cannot hold the tokenizer's {tokenizer.vocab_size} tokens")
    maker, (want, file_type) = ARCHES[arch], DTYPES[dtype]
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(None, maker.gguf_arch, use_temp_file=True)  # tensors spill to disk
    writer.add_type(gguf.GGUFType.MODEL)
    if name is not None:
        writer.add_name(name)
    maker.gguf_metadata(writer, shape)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer.write_gguf(writer, pad_to=shape.vocab)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    try:
        for group in groups:
            for tensor_name, t in maker.to_gguf(shape, group):
                data, qtype = gguf_storage(tensor_name, t, want)
                writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file(path=part)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, out_path)
    finally:
        writer.close()
        part.unlink(missing_ok=True)
    return out_path


def make_model(arch: str, preset: str, dtype: str, out_path: str | Path, seed: int = 0,
               hf_dir: str | Path | None = None,
               progress: Callable[[str], None] | None = None) -> MadeModel:
    """Write a random-weight GGUF of `arch` ("qwen35", "qwen35moe", "qwen3next", "kimi-linear") at `preset`
    ("tiny", "0.8b" for Qwen; "tiny", "small" for Kimi) and `dtype` ("f32", "f16", "q8_0") to `out_path`,
    and with `hf_dir` the same weights as a Hugging Face directory (config.json, model.safetensors, tokenizer
    files).
    The same arguments and seed give the same weights whatever the dtype."""
    if arch not in ARCHES:
        raise DeltaserveError(f"unknown architecture '{arch}' (known: {', '.join(ARCHES)})")
    maker = ARCHES[arch]
    if preset not in maker.presets:
        raise DeltaserveError(f"unknown preset '{preset}' for {arch} (known: {', '.join(maker.presets)})")
    if dtype not in DTYPES:
        raise DeltaserveError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    hf_dir = Path(hf_dir) if hf_dir is not None else None
    report = progress or (lambda line: None)

    tokenizer = train_tokenizer()
    shape = maker.presets[preset]
    if shape.vocab is None:
        shape = replace(shape, vocab=tokenizer.vocab_size)
    elif shape.vocab < tokenizer.vocab_size:
        raise DeltaserveError(f"{arch} {preset}: vocab {shape.vocab} is smaller than the tokenizer's "
                              f"{tokenizer.vocab_size} tokens")

    hf_stream = None
    if hf_dir is not None:
        hf_dir.mkdir(parents=True, exist_ok=True)
        hf_stream = _SafetensorsStream(hf_dir / "model.safetensors")
    start, total = time.monotonic(), shape.layers + 2

    def groups() -> Iterator[Group]:  # each group also goes to the Hugging Face copy
        for done, group in enumerate(maker.hf_tensors(shape, Draw(seed), tokenizer.vocab_size), 1):
            if hf_stream is not None:
                for name, t in group.items():
                    hf_stream.add(name, t)
            yield group
            report(f"{arch} {preset} {dtype}: {done}/{total} tensor groups, {time.monotonic() - start:.1f}s")

    try:
        write_gguf(out_path, arch, shape, tokenizer, groups(), dtype, name=f"deltaserve random {arch} {preset}")
        if hf_stream is not None:
            hf_stream.close()
            hf_stream = None
    finally:
        if hf_stream is not None:
            hf_stream.abort()

    if hf_dir is not None:
        (hf_dir / "config.json").write_text(json.dumps(maker.hf_config(shape, tokenizer), indent=2) + "\n")
        tokenizer.save_hf_dir(hf_dir)
    return MadeModel(out_path, hf_dir, arch, shape, tokenizer)


# -- command line ----------------------------------------------------------------------------------

def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of `deltaserve make-model`; pass a subparser to add them to it."""
    parser = parser or argparse.ArgumentParser(prog="deltaserve make-model",
                                               description="Write a random-weight model (GGUF, optionally HF).")
    parser.add_argument("--arch", required=True, choices=sorted(ARCHES), help="GGUF architecture")
    parser.add_argument("--preset", choices=PRESETS, default="tiny",
                        help="tiny: test sizes; 0.8b: Qwen3.5-0.8B's shapes (Qwen); small: ~90M parameters "
                             "(kimi-linear) (default: tiny)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f16", help="GGUF file type (default: f16)")
    parser.add_argument("out", type=Path, help="GGUF file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--hf-dir", type=Path, default=None,
                        help="also write the same weights as a Hugging Face directory here")
    return parser


def run(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        print(f"\r{line}", end="", file=sys.stderr, flush=True)

    made = make_model(args.arch, args.preset, args.dtype, args.out, seed=args.seed, hf_dir=args.hf_dir,
                      progress=progress)
    size = made.gguf_path.stat().st_size
    print(f"\nwrote {made.gguf_path} ({size / 2**20:.1f} MiB, vocab {made.shape.vocab})"
          + (f" and {made.hf_dir}" if made.hf_dir else ""), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except DeltaserveError as error:
        print(f"deltaserve make-model: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
