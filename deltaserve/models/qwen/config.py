"""The shape of a Qwen hybrid model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), read from either format.

One dataclass covers the three architectures: a stack of Gated DeltaNet ("linear_attention") and
gated full-attention ("full_attention") layers, each followed by a dense SwiGLU MLP or a softmax-routed
MoE with a gated shared expert. `from_hf` reads a transformers config.json, `from_gguf` reads GGUF
metadata; both hand their numbers to the constructor, which checks that they fit together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.models.checks import (MAX_EXPERTS, MAX_LAYERS, MAX_SIZE, REQUIRED, ConfigReader, check_hybrid,
                                      check_layers, reads_config)

ARCHS = ("qwen35", "qwen35moe", "qwen3next")

# transformers model_type -> GGUF architecture name (our canonical name)
_HF_ARCH = {
    "qwen3_5": "qwen35",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
}


@dataclass(frozen=True)
class QwenConfig:
    arch: str  # "qwen35" | "qwen35moe" | "qwen3next"
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one per trunk layer; MTP layers are not counted
    ffn_types: tuple[str, ...]  # "dense" | "moe", one per trunk layer
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # rope acts on the first rotary_dim channels of each head
    rope_theta: float
    rms_norm_eps: float
    # Gated DeltaNet: H key heads of size K, HV value heads of size V
    conv_kernel: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    # feed-forward
    intermediate_size: int = 0  # dense MLP width (0: no dense layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mtp_layers: int = 0  # multi-token-prediction blocks after the trunk (one is loaded where the file has it)
    max_position_embeddings: int = 0  # 0: not stated

    def __post_init__(self):
        def bad(problem: str):
            raise DeltaserveError(f"invalid Qwen config: {problem}")

        if self.arch not in ARCHS:
            bad(f"arch {self.arch!r} is not one of {ARCHS}")
        check_hybrid(self, "Qwen", ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                    "conv_kernel", "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim"))
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.linear_v_heads % self.linear_k_heads:
            bad(f"linear value heads ({self.linear_v_heads}) is not a multiple of "
                f"linear key heads ({self.linear_k_heads})")
        if not (0 < self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            bad(f"rotary_dim ({self.rotary_dim}) must be even and in (0, head_dim={self.head_dim}]")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            bad(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be positive")
        if self.shared_expert_intermediate_size < 0 or self.mtp_layers < 0:
            bad("shared_expert_intermediate_size and mtp_layers cannot be negative")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mtp_ffn(self) -> str:
        """The MTP layer's feed-forward: Qwen3.5's is dense, the MoE models' routed."""
        return "dense" if self.arch == "qwen35" else "moe"

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k (H*K each) and v (HV*V)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    # ------------------------------------------------------------------ transformers
    @classmethod
    @reads_config("config.json")
    def from_hf(cls, config: Mapping[str, Any], source: str = "config.json", *,
                max_layers: int | None = None) -> QwenConfig:
        """Read a transformers config dict (qwen3_next, qwen3_5[_text], qwen3_5_moe[_text]). max_layers: the
        layers whose tensors the checkpoint holds, a bound on num_hidden_layers checked before any list is built."""
        top = ConfigReader(config, source)
        model_type = top.raw("model_type", None)
        if not isinstance(model_type, str) or model_type not in _HF_ARCH:
            raise ModelLoadError(source, f"model_type {model_type!r} is not a Qwen hybrid model "
                                         f"(expected one of {sorted(_HF_ARCH)})")
        arch = _HF_ARCH[model_type]
        r = top.nested("text_config") if top.has("text_config") else top  # the vision-language checkpoints nest the LM
        if r.text("hidden_act", "silu") != "silu":
            r.fail("hidden_act", f"is {r.raw('hidden_act')!r}; only silu is supported")
        if r.flag("attention_bias", False):
            r.fail("attention_bias", "is true, which is not supported")
        rope = r.nested("rope_parameters") if r.has("rope_parameters") else r.nested("rope_scaling")
        rope_type = rope.text("rope_type") if rope.has("rope_type") else rope.text("type", "default")
        if rope_type != "default":
            raise ModelLoadError(source, f"rope type {rope_type!r} is not supported (only default)")
        theta = (rope if rope.has("rope_theta") else r).float("rope_theta", 10000.0, low=0, open_low=True)
        partial = (rope if rope.has("partial_rotary_factor") else r).float("partial_rotary_factor", 0.25, low=0,
                                                                           high=1, open_low=True)

        n_layers = r.int("num_hidden_layers", low=1, high=MAX_LAYERS)
        check_layers(r, "num_hidden_layers", n_layers, max_layers)
        hidden, heads = r.int("hidden_size", low=1), r.int("num_attention_heads", low=1)
        head_dim = r.int("head_dim", 0) or hidden // heads
        if r.has("layer_types"):
            layer_types = r.items("layer_types", str, length=(n_layers, n_layers))
        else:
            interval = r.int("full_attention_interval", 4, low=1)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]

        moe = {}
        if arch == "qwen35":
            ffn_types = ["dense"] * n_layers
        else:
            moe = dict(num_experts=r.int("num_experts", high=MAX_EXPERTS), num_experts_per_tok=r.int("num_experts_per_tok"),
                       moe_intermediate_size=r.int("moe_intermediate_size"),
                       shared_expert_intermediate_size=r.int("shared_expert_intermediate_size", 0),
                       # Qwen3.5-MoE always renormalises the top-k weights: its router has no switch, and
                       # transformers ignores the key where a config has it
                       norm_topk_prob=arch == "qwen35moe" or r.flag("norm_topk_prob", True))
            if arch == "qwen35moe":
                ffn_types = ["moe"] * n_layers
            else:  # Qwen3-Next may keep some layers dense
                only_mlp = set(r.items("mlp_only_layers", int, []))
                step = r.int("decoder_sparse_step", 1, low=1)
                ffn_types = ["moe" if i not in only_mlp and moe["num_experts"] > 0 and (i + 1) % step == 0
                             else "dense" for i in range(n_layers)]
        mtp = r.int("mtp_num_hidden_layers") if r.has("mtp_num_hidden_layers") else r.int("num_nextn_predict_layers", 0)
        return cls(
            arch=arch, vocab_size=r.int("vocab_size", low=1), hidden_size=hidden,
            layer_types=tuple(layer_types), ffn_types=tuple(ffn_types),
            num_heads=heads, num_kv_heads=r.int("num_key_value_heads", low=1), head_dim=head_dim,
            rotary_dim=int(head_dim * partial), rope_theta=theta,
            rms_norm_eps=r.float("rms_norm_eps", 1e-6, low=0, high=1, open_low=True),
            conv_kernel=r.int("linear_conv_kernel_dim", 4),
            linear_k_heads=r.int("linear_num_key_heads", low=1), linear_v_heads=r.int("linear_num_value_heads", low=1),
            linear_k_dim=r.int("linear_key_head_dim", low=1), linear_v_dim=r.int("linear_value_head_dim", low=1),
            intermediate_size=r.int("intermediate_size", 0),
            tie_word_embeddings=r.flag("tie_word_embeddings", top.flag("tie_word_embeddings", False)),
            mtp_layers=mtp, max_position_embeddings=r.int("max_position_embeddings", 0),
            **moe,
        )

    # ------------------------------------------------------------------ GGUF
    @classmethod
    @reads_config("gguf")
    def from_gguf(cls, metadata: Mapping[str, Any], source: str = "gguf", *, vocab_size: int | None = None,
                  tie_word_embeddings: bool = False, max_layers: int | None = None) -> QwenConfig:
        """Read llama.cpp GGUF metadata. The vocabulary size and whether the output matrix is tied
        are facts of the tensors, not the metadata: the caller passes them when it has the file, and
        max_layers, the blocks whose tensors it holds (a bound on block_count checked before any list is built)."""
        top = ConfigReader(metadata, source)
        arch = top.raw("general.architecture", None)
        if not isinstance(arch, str) or arch not in ARCHS:
            raise ModelLoadError(source, f"general.architecture {arch!r} is not one of {ARCHS}")
        r = top.under(f"{arch}.")
        blocks = r.int("block_count", low=1, high=MAX_LAYERS)
        mtp = r.int("nextn_predict_layers", 0, high=blocks - 1)
        n_layers = blocks - mtp  # MTP blocks are appended after the trunk
        check_layers(r, "block_count", n_layers, max_layers)
        if r.has("attention.recurrent_layers"):
            recurrent = r.items("attention.recurrent_layers", bool, length=(n_layers, blocks))
            layer_types = ["linear_attention" if x else "full_attention" for x in recurrent[:n_layers]]
        else:
            interval = r.int("full_attention_interval", 4, low=1)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        attn_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]

        def num(key: str, default: Any = REQUIRED, layers: list[int] | None = None, low: int = 0,
                high: int = MAX_SIZE) -> int:
            # llama.cpp allows per-layer arrays (head counts, widths); ours must agree where they are used
            return r.per_layer(key, default, n_layers=n_layers, blocks=blocks, layers=layers, low=low, high=high)

        hidden, heads = num("embedding_length", low=1), num("attention.head_count", layers=attn_layers, low=1)
        head_dim = num("attention.key_length", hidden // heads, low=1)
        if num("attention.value_length", head_dim) != head_dim:
            raise ModelLoadError(source, "attention key_length and value_length differ")
        v_heads, inner = num("ssm.time_step_rank", low=1), num("ssm.inner_size", low=1)
        if inner % v_heads:
            raise ModelLoadError(source, f"ssm.inner_size ({inner}) is not a multiple of "
                                         f"ssm.time_step_rank ({v_heads})")
        if vocab_size is None:
            vocab_size = r.int("vocab_size", 0) or len(top.items("tokenizer.ggml.tokens", str, []))

        moe = {}
        if arch == "qwen35":
            ffn_types = ["dense"] * n_layers
        else:
            ffn_types = ["moe"] * n_layers
            # llama.cpp falls back to the dense width when the shared expert width is not stated
            shared = num("expert_shared_feed_forward_length", num("feed_forward_length", 0))
            moe = dict(num_experts=num("expert_count", high=MAX_EXPERTS), num_experts_per_tok=num("expert_used_count"),
                       moe_intermediate_size=num("expert_feed_forward_length"),
                       shared_expert_intermediate_size=shared, norm_topk_prob=r.flag("expert_weights_norm", True))
        return cls(
            arch=arch, vocab_size=vocab_size, hidden_size=hidden,
            layer_types=tuple(layer_types), ffn_types=tuple(ffn_types),
            num_heads=heads, num_kv_heads=num("attention.head_count_kv", layers=attn_layers),
            head_dim=head_dim, rotary_dim=num("rope.dimension_count", head_dim),
            rope_theta=r.float("rope.freq_base", 10000.0, low=0, open_low=True),
            rms_norm_eps=r.float("attention.layer_norm_rms_epsilon", low=0, high=1, open_low=True),
            conv_kernel=num("ssm.conv_kernel"), linear_k_heads=num("ssm.group_count"), linear_v_heads=v_heads,
            linear_k_dim=num("ssm.state_size"), linear_v_dim=inner // v_heads,
            intermediate_size=num("feed_forward_length") if arch == "qwen35" else 0,
            tie_word_embeddings=tie_word_embeddings, mtp_layers=mtp, max_position_embeddings=num("context_length", 0),
            **moe,
        )

    # ------------------------------------------------------------------ writing (the inverse of the readers)
    def to_hf(self) -> dict[str, Any]:
        """The transformers config.json of this shape (from_hf reads it back to an equal config)."""
        model_type, cls = _HF_WRITE[self.arch]
        interval = _interval(self.layer_types)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rotary_dim / self.head_dim}
        if self.arch != "qwen3next":  # interleaved M-RoPE sections over (time, height, width)
            rope |= {"mrope_section": self.mrope_sections, "mrope_interleaved": True}
        config = {
            "architectures": [cls], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False, "rope_parameters": rope, "layer_types": list(self.layer_types),
            "linear_conv_kernel_dim": self.conv_kernel, "linear_key_head_dim": self.linear_k_dim,
            "linear_value_head_dim": self.linear_v_dim, "linear_num_key_heads": self.linear_k_heads,
            "linear_num_value_heads": self.linear_v_heads, "dtype": "bfloat16",
        }
        if interval:
            config["full_attention_interval"] = interval
        if self.intermediate_size:
            config["intermediate_size"] = self.intermediate_size
        if self.mtp_layers:
            config["mtp_num_hidden_layers"] = self.mtp_layers
        if self.arch != "qwen35":
            config |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                       "moe_intermediate_size": self.moe_intermediate_size,
                       "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                       "norm_topk_prob": self.norm_topk_prob}
        if self.arch == "qwen3next":
            config |= {"decoder_sparse_step": 1,
                       "mlp_only_layers": [i for i, t in enumerate(self.ffn_types) if t == "dense"]}
        return config

    def to_gguf(self, writer) -> None:
        """This shape as llama.cpp's GGUF metadata (a gguf.GGUFWriter; from_gguf reads it back)."""
        w, interval = writer, _interval(self.layer_types)
        w.add_block_count(self.num_layers + self.mtp_layers)
        if self.mtp_layers:
            w.add_uint32(f"{self.arch}.nextn_predict_layers", self.mtp_layers)
        w.add_context_length(self.max_position_embeddings)
        w.add_embedding_length(self.hidden_size)
        if self.intermediate_size:
            w.add_feed_forward_length(self.intermediate_size)
        w.add_head_count(self.num_heads)
        w.add_head_count_kv(self.num_kv_heads)
        if self.arch != "qwen3next":
            w.add_rope_dimension_sections([*self.mrope_sections, 0])
        w.add_rope_freq_base(self.rope_theta)
        w.add_layer_norm_rms_eps(self.rms_norm_eps)
        if self.arch != "qwen35":
            w.add_expert_count(self.num_experts)
            w.add_expert_used_count(self.num_experts_per_tok)
            w.add_expert_feed_forward_length(self.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(self.shared_expert_intermediate_size)
            w.add_expert_weights_norm(self.norm_topk_prob)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_ssm_conv_kernel(self.conv_kernel)
        w.add_ssm_state_size(self.linear_k_dim)
        w.add_ssm_group_count(self.linear_k_heads)
        w.add_ssm_time_step_rank(self.linear_v_heads)
        w.add_ssm_inner_size(self.linear_v_heads * self.linear_v_dim)
        if interval:
            w.add_full_attention_interval(interval)
        else:
            w.add_array(f"{self.arch}.attention.recurrent_layers",  # one per block, MTP ones too (as the converter)
                        [t == "linear_attention" for t in self.layer_types] + [False] * self.mtp_layers)
        w.add_rope_dimension_count(self.rotary_dim)

    @property
    def mrope_sections(self) -> list[int]:
        """Rotary pairs split over (time, height, width), like Qwen's [11, 11, 10] for 32 pairs."""
        base, rest = divmod(self.rotary_dim // 2, 3)
        return [base + (rest > 0), base + (rest > 1), base]


# our architecture -> what a checkpoint of its text model says it is (model_type, transformers class)
_HF_WRITE = {"qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"), "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
             "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM")}


def _interval(layer_types) -> int | None:
    """n where layer i is full attention exactly when (i + 1) % n == 0, else None."""
    return next((n for n in range(1, len(layer_types) + 2)
                 if all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types))), None)
