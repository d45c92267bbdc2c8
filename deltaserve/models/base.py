"""What every hybrid family shares: the trunk (embedding, layers, final norm, output head), the per-slot
state, the cached forward with snapshots, and building from a checkpoint through the family's weight table.

A family subclasses `HybridModel` and provides its config class, its layers (`make_layer`), the sizes of
its state (`state_sizes`), how a full-attention layer is called (`attend`) and its checkpoint contract
(`weight_table`, see models/weights.py). Everything else, loading included, is here once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from deltaserve.models.common import build, check_batch, check_ids, lm_logits
from deltaserve.models.layers import Embedding, Linear, RMSNorm
from deltaserve.models.mtp import follow, has_mtp, with_mtp
from deltaserve.models.state import HybridState, Snapshots
from deltaserve.models.weights import Param


class HybridModel(nn.Module, ABC):
    """Recurrent ("linear_attention") and full-attention layers, each followed by an MLP or an MoE.

    compute_dtype: the activations' dtype (and the conv state's). cache_dtype: the KV cache's (None: as the
    activations). Every layer has `.recurrent`, `.input_norm`, `.mixer`, `.post_norm` and `.ffn`; a
    recurrent mixer takes (x, conv_state, ssm_state, slots, snapshots=K)."""

    config_class: type
    gguf_archs: tuple[str, ...] = ()  # general.architecture values this family reads
    hf_model_types: tuple[str, ...] = ()  # config.json model_type values this family reads
    keep_fp32: tuple[str, ...] = ("norm.weight", ".A", ".dt_bias", "conv_weight")  # names kept float32
    supports_snapshots = True  # forward(..., snapshots=K) keeps per-token states: speculative rollback works
    supports_training = False  # forward without a state runs whole sequences differentiably

    def __init__(self, config, compute_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
                 mtp: bool = True):
        """mtp=False: without the multi-token-prediction layer even where the config has one (its checkpoint
        lacks it)."""
        super().__init__()
        self.config = config
        self.compute_dtype = compute_dtype
        self.cache_dtype = cache_dtype
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.mtp = self.make_mtp(config) if mtp else None  # models/mtp.py

    # -- what a family provides ---------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def weight_table(cls, config, hf_root: str = "model.") -> list[Param]:
        """Every parameter with its Hugging Face and GGUF layouts (hf_root: where the language model's
        tensors live in a transformers checkpoint)."""
        ...

    @abstractmethod
    def make_layer(self, config, index: int) -> nn.Module:
        ...

    @abstractmethod
    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Per slot: conv (W-1, channels), ssm (heads, K, V), and per token k / v (kv heads, width)."""
        ...

    def make_mtp(self, config) -> nn.Module | None:
        """The multi-token-prediction layer (models/mtp.MTPHead) the config describes, or None."""
        return None

    def rope(self, positions: torch.Tensor):
        """What the attention layers need of the positions [N, T] (None: no rotary embedding)."""
        return None

    @abstractmethod
    def attend(self, layer: nn.Module, x: torch.Tensor, rope, k_cache, v_cache, slots, start) -> torch.Tensor:
        """A full-attention layer's mixer over x [N, T, E], continuing cache rows `slots` from `start`."""
        ...

    # -- shared -------------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, ckpt, dtype: torch.dtype = torch.float32, device="cpu",
                        weight_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None, part=None):
        """Build from an opened checkpoint (a GGUF file or a transformers directory). Parameters named in
        `keep_fp32` stay float32; every other weight is stored in `weight_dtype` (default `dtype`).
        part: cuts the model down to what this process holds before anything loads (see common.build)."""
        return build(cls, ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype, kv_dtype=kv_dtype, part=part)

    def new_state(self, n_slots: int, max_len: int, mtp: bool = False) -> HybridState:
        """mtp: with the MTP layer's cache, which every cached forward then extends (speculative drafting)."""
        s = self.state_sizes()
        state = HybridState.allocate([layer.recurrent for layer in self.layers], n_slots, max_len,
                                     conv=s["conv"], ssm=s["ssm"], k=s["k"], v=s["v"], dtype=self.compute_dtype,
                                     kv_dtype=self.cache_dtype, device=self.embed.weight.device)
        return with_mtp(self, state) if mtp else state

    def forward(self, input_ids: torch.Tensor, state: HybridState | None = None, slots=None,
                logits: str = "last", snapshots: int = 0) -> torch.Tensor:
        """Continue N sequences by T tokens each. input_ids [N, T]; slots [N] rows of `state`.

        Writes the new recurrent state and KV entries in place and advances state.lengths[slots] by T.
        Returns float32 logits [N, vocab] for the last token ("last") or [N, T, vocab] ("all").
        snapshots=K > 0 also keeps in state.snapshots the recurrent states after each of the last K
        tokens, so that state.rollback can return any slot to one of those positions.
        Without `state` (training, where the family supports it): each row is a whole sequence from an
        empty state, nothing is kept, gradients flow, and the logits of every position come back (or with
        logits="hidden" the final-normed hidden states [N, T, E]).
        A state made with mtp=True also gets the MTP layer's entries for the tokens (models/mtp.py).
        With logits="last" and no snapshots, N * T tokens beyond `pass_tokens` run in passes of at most that many.
        """
        if state is None:
            if not self.supports_training:
                raise TypeError(f"{type(self).__name__}.forward needs a state (see new_state)")
            input_ids = check_ids(input_ids, self.config.vocab_size).to(self.embed.weight.device)
            N, T = input_ids.shape
            return self._trunk(input_ids, torch.arange(T, device=input_ids.device).expand(N, T),
                               None, None, None, "hidden" if logits == "hidden" else "all")
        with torch.inference_mode():
            input_ids, slots = check_batch(self, input_ids, state, slots, logits)
            N, T = input_ids.shape
            # one pass where every position's logits come back (1 MB a token at Qwen3.5's vocabulary: passes
            # would save nothing) or snapshots are kept (verify passes are short)
            step = T if logits == "all" or snapshots else max(1, self.pass_tokens // N)
            for i in range(0, T, step):
                out = self._cached(input_ids[:, i:i + step], state, slots, logits if i + step >= T else "none",
                                   snapshots)
            return out

    # Tokens a cached forward pass takes at most, all rows together: a pass's activations are the memory it takes
    # beyond the weights and caches (at 512 tokens of a 0.8B model, 30 MB of a quantised file's ~850 MB peak), and
    # each pass streams every matmul weight once and opens the K-quants' panels once. Passes of 256 for quantised
    # weights had cost the Q4_K_M 0.8B file 5-6% of its prefill on the AMX Xeon (2-8% on vpdpbusd), for 15 MB less
    # peak RSS; passes of 256 cost a Zen 5 8-17% of a BF16 file's prefill and 3% of an F16 file's.
    pass_tokens = 512

    def _cached(self, input_ids, state: HybridState, slots, logits: str, snapshots: int) -> torch.Tensor | None:
        """One pass of forward with a state (logits "none": a pass before the last, whose logits nobody reads)."""
        start = state.lengths[slots]  # [N] tokens already in each slot
        T = input_ids.shape[1]
        snaps = Snapshots(slots.tolist(), (start + T).tolist(), T, snapshots, [None] * len(state.conv),
                          [None] * len(state.conv)) if snapshots else None
        out = self._trunk(input_ids, start[:, None] + torch.arange(T, device=start.device), state, slots, start,
                          logits, snaps)
        state.lengths[slots] = start + T
        if snaps is not None:
            state.snapshots = snaps
        return out

    def _trunk(self, input_ids, positions, state: HybridState | None, slots, start, logits: str,
               snaps: Snapshots | None = None) -> torch.Tensor | None:
        rope = self.rope(positions)
        # the embeddings passed on, not kept here: run_layers lets go of each layer's input once it has the next
        h = self.run_layers(self.embed(input_ids, self.compute_dtype), rope, state, slots, start, snaps,
                            range(len(self.layers)))
        following = has_mtp(self, state)  # the MTP layer reads every position's hidden state
        if logits == "none" and not following:
            return None
        h = self.norm(h[:, -1] if logits == "last" and not following else h)
        if following:
            follow(self, input_ids, h, rope, state, slots, start, snaps)
            h = h[:, -1] if logits == "last" else h
        return h if logits == "hidden" else None if logits == "none" else lm_logits(self, h)

    def run_layers(self, h: torch.Tensor, rope, state: HybridState | None, slots, start, snaps: Snapshots | None,
                   layers: range) -> torch.Tensor:
        """Hidden states h [N, T, E] through layers `layers` (all of them, or a pipeline stage's own)."""
        if state is not None:
            stepped = self.decode_step(h, rope, state, slots, start, layers, snaps)
            if stepped is not None:
                return stepped
        for i in layers:
            layer = self.layers[i]
            x = layer.input_norm(h)
            if layer.recurrent and snaps is not None:
                x, snaps.conv[i], snaps.ssm[i] = layer.mixer(x, state.conv[i], state.ssm[i], slots,
                                                             snapshots=snaps.depth)
            elif layer.recurrent:  # the ops read and write the cache rows of `slots` in place
                conv, ssm = (None, None) if state is None else (state.conv[i], state.ssm[i])
                x = layer.mixer(x, conv, ssm, slots)
            else:
                k_cache, v_cache = (None, None) if state is None else (state.k[i], state.v[i])
                x = self.attend(layer, x, rope, k_cache, v_cache, slots, start)
            h = h + x
            del x  # not held through the FFN, whose activations are the pass's largest
            h = h + layer.ffn(layer.post_norm(h))
        return h


    def decode_step(self, h: torch.Tensor, rope, state: HybridState, slots, start, layers: range,
                    snaps: Snapshots | None = None) -> torch.Tensor | None:
        """run_layers in one C++ call where the family has one and this step (or verify pass keeping snapshots)
        is its case (None: the modules run)."""
        return None

    def mtp_follow(self, ids, before, rope, k_cache, v_cache, slots, start) -> bool:
        """models/mtp.follow's cache writes in one call where the family has one (False: the modules run)."""
        return False

    def mtp_draft(self, state: HybridState, slots, ids, hidden, ks: list[int]) -> list[list[int]] | None:
        """models/mtp.draft's chained drafts in one call where the family has one (None: the modules run)."""
        return None

    def mtp_greedy_step(self, state: HybridState, slots: torch.Tensor, ids: torch.Tensor, ks: list[int]):
        """A whole greedy speculative step with the MTP layer's drafts (drafts, verify pass, acceptance, rollback)
        in one call where the family has one: (drafts [N, max k], accepted drafts [N], next tokens [N]), the slots
        advanced past the pending tokens and the accepted drafts; None: nothing done (draft and verify in steps)."""
        return None


def conv_tape(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[conv state before x | x], [N, W-1+T, C]: the conv state after token t of x is rows t+1 .. t+W-1
    (HybridState.rollback reads them), so snapshots of the short conv cost one concatenation."""
    return torch.cat([conv_state[slots].to(x.dtype), x], dim=1)

