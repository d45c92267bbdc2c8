"""The shape of a Kimi Linear model, read from (and written to) either format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.models.checks import (MAX_EXPERTS, MAX_LAYERS, MAX_SIZE, REQUIRED, ConfigReader, check_hybrid,
                                      check_layers, reads_config)


KIMI_ARCH = "kimi-linear"
MAX_SCALE = 1000.0  # of the routed experts' output (Kimi's is 2.446): past that, activations overflow


@dataclass(frozen=True)
class KimiConfig:
    """Kimi Linear: KDA layers ("linear_attention") and rope-less MLA layers ("full_attention"), each
    followed by a dense SwiGLU MLP or a sigmoid-routed MoE with ungated shared experts."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "linear_attention" (KDA) | "full_attention" (MLA), one per layer
    ffn_types: tuple[str, ...]  # "dense" | "moe", one per layer
    rms_norm_eps: float
    # KDA: heads of size head_dim for q, k and v alike, each with its own short conv
    conv_kernel: int
    kda_heads: int
    kda_head_dim: int
    # MLA: queries nope | rope per head; keys and values expanded from a shared latent of kv_lora_rank
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the shared key part; Kimi applies no rotation to it
    v_head_dim: int
    q_lora_rank: int = 0  # 0: a full-rank q projection
    mla_norm_eps: float = 1e-6  # of kv_a_norm / q_a_norm: transformers 1e-6, llama.cpp rms_norm_eps
    # decay g = A * softplus(x + dt_bias), or lower_bound * sigmoid(-A * (x + dt_bias)) when set
    gate_lower_bound: float | None = None
    # feed-forward
    intermediate_size: int = 0  # dense MLP width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # their MLP is moe_intermediate_size * num_shared_experts wide
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1  # experts form n_group groups; routing keeps the topk_group best groups
    topk_group: int = 1
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0  # 0: not stated

    def __post_init__(self):
        def bad(problem: str):
            raise DeltaserveError(f"invalid Kimi Linear config: {problem}")

        check_hybrid(self, "Kimi Linear", ("vocab_size", "hidden_size", "conv_kernel", "kda_heads", "kda_head_dim",
                                           "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))
        if self.qk_rope_head_dim < 0 or self.q_lora_rank < 0:
            bad("qk_rope_head_dim and q_lora_rank cannot be negative")
        if self.rms_norm_eps <= 0 or self.mla_norm_eps <= 0:
            bad(f"norm epsilons must be positive, got {self.rms_norm_eps} and {self.mla_norm_eps}")
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            bad(f"gate_lower_bound ({self.gate_lower_bound}) must be negative (it bounds a log-decay)")
        if "moe" in self.ffn_types:
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                bad(f"{self.num_experts} experts cannot form {self.n_group} groups with {self.topk_group} kept")
        if self.num_shared_experts < 0:
            bad("num_shared_experts cannot be negative")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_dim(self) -> int:
        """Width of each of q, k and v in a KDA layer."""
        return self.kda_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    # ------------------------------------------------------------------ transformers
    @classmethod
    @reads_config("config.json")
    def from_hf(cls, config: Mapping[str, Any], source: str = "config.json", *,
                max_layers: int | None = None) -> KimiConfig:
        """Read a kimi_linear config.json, as Moonshot released it (linear_attn_config, first_k_dense_replace)
        or as transformers saves it (layer_types, mlp_layer_types, linear_* keys). max_layers: the layers whose
        tensors the checkpoint holds, a bound on num_hidden_layers checked before any list is built."""
        r = ConfigReader(config, source)
        if r.raw("model_type", None) != "kimi_linear":
            raise ModelLoadError(source, f"model_type {r.raw('model_type', None)!r} is not 'kimi_linear'")

        def key(*names: str) -> str:  # the first of several names a value goes by that the config has
            return next((k for k in names if r.has(k)), names[0])

        if r.text("hidden_act", "silu") != "silu":
            r.fail("hidden_act", f"is {r.raw('hidden_act')!r}; only silu is supported")
        if r.flag("attention_bias", False):
            r.fail("attention_bias", "is true, which is not supported")
        if r.text("moe_router_activation_func", "sigmoid") != "sigmoid":
            r.fail("moe_router_activation_func", f"is {r.raw('moe_router_activation_func')!r}; only sigmoid is supported")
        linear = r.nested("linear_attn_config")
        n_layers = r.int("num_hidden_layers", low=1, high=MAX_LAYERS)
        check_layers(r, "num_hidden_layers", n_layers, max_layers)
        if r.has("layer_types"):
            layer_types = r.items("layer_types", str, length=(n_layers, n_layers))
        elif linear.has("kda_layers") and linear.has("full_attn_layers"):
            kda = set(linear.items("kda_layers", int))  # 1-based layer numbers
            layer_types = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n_layers)]
            if kda | set(linear.items("full_attn_layers", int)) != set(range(1, n_layers + 1)):
                raise ModelLoadError(source, f"linear_attn_config kda_layers / full_attn_layers do not cover "
                                             f"layers 1..{n_layers}")
        else:
            raise ModelLoadError(source, "missing layer_types (or linear_attn_config kda_layers / full_attn_layers)")

        n_experts = r.int(key("num_experts", "num_local_experts", "n_routed_experts"), 0, high=MAX_EXPERTS)
        if r.has("mlp_layer_types"):
            ffn_types = ["moe" if t == "sparse" else t
                         for t in r.items("mlp_layer_types", str, length=(n_layers, n_layers))]
        else:  # Moonshot's rule: the first k layers dense, then MoE every moe_layer_freq-th layer
            first, freq = r.int("first_k_dense_replace", 1), r.int("moe_layer_freq", 1, low=1)
            ffn_types = ["moe" if n_experts and i >= first and i % freq == 0 else "dense" for i in range(n_layers)]
        lower = linear.float("gate_lower_bound") if linear.has("gate_lower_bound") else None
        if lower is None and linear.flag("safe_gate", False):
            lower = -5.0  # fla's default bound for the safe gate
        def kda(name: str, flat_name: str, default: int) -> int:  # in linear_attn_config, or flat (transformers)
            return linear.int(name) if linear.has(name) else r.int(flat_name, default)

        return cls(
            vocab_size=r.int("vocab_size", low=1), hidden_size=r.int("hidden_size", low=1),
            layer_types=tuple(layer_types), ffn_types=tuple(ffn_types),
            rms_norm_eps=r.float("rms_norm_eps", 1e-5, low=0, high=1, open_low=True),
            conv_kernel=kda("short_conv_kernel_size", "linear_conv_kernel_dim", 4),
            kda_heads=kda("num_heads", "linear_num_heads", 32), kda_head_dim=kda("head_dim", "linear_head_dim", 128),
            num_heads=r.int("num_attention_heads", low=1), kv_lora_rank=r.int("kv_lora_rank", low=1),
            qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
            v_head_dim=r.int("v_head_dim"), q_lora_rank=r.int("q_lora_rank", 0),
            mla_norm_eps=1e-6,  # transformers and Moonshot's code build these norms with the default eps
            gate_lower_bound=lower,
            intermediate_size=r.int("intermediate_size", 0), num_experts=n_experts,
            num_experts_per_tok=r.int(key("num_experts_per_token", "num_experts_per_tok"), 0),
            moe_intermediate_size=r.int("moe_intermediate_size", 0),
            num_shared_experts=r.int(key("num_shared_experts", "n_shared_experts"), 0),
            routed_scaling_factor=r.float("routed_scaling_factor", 1.0, low=0, high=MAX_SCALE, open_low=True),
            norm_topk_prob=r.flag(key("moe_renormalize", "norm_topk_prob"), True),
            n_group=r.int(key("num_expert_group", "n_group"), 1, low=1), topk_group=r.int("topk_group", 1, low=1),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            max_position_embeddings=r.int(key("model_max_length", "max_position_embeddings"), 0),
        )

    # ------------------------------------------------------------------ GGUF
    @classmethod
    @reads_config("gguf")
    def from_gguf(cls, metadata: Mapping[str, Any], source: str = "gguf", *, vocab_size: int | None = None,
                  tie_word_embeddings: bool = False, max_layers: int | None = None) -> KimiConfig:
        """Read llama.cpp `kimi-linear` metadata: KDA layers are those with attention.head_count_kv 0, and
        both layer kinds take their head count from attention.head_count (per layer when an array).
        max_layers: the blocks whose tensors the file holds, a bound on block_count checked before any list."""
        top = ConfigReader(metadata, source)
        arch = top.raw("general.architecture", None)
        if arch != KIMI_ARCH:
            raise ModelLoadError(source, f"general.architecture {arch!r} is not {KIMI_ARCH!r}")
        r = top.under(f"{arch}.")
        n_layers = r.int("block_count", low=1, high=MAX_LAYERS)
        check_layers(r, "block_count", n_layers, max_layers)
        if not isinstance(r.raw("attention.head_count_kv"), (list, tuple)):
            r.fail("attention.head_count_kv", "must list every layer (0 marks a KDA layer), "
                                              f"got {r.raw('attention.head_count_kv')!r}")
        kv_heads = r.items("attention.head_count_kv", int, length=(n_layers, n_layers))
        layer_types = ["linear_attention" if n == 0 else "full_attention" for n in kv_heads]

        def num(key: str, default: Any = REQUIRED, layers: list[int] | None = None, low: int = 0,
                high: int = MAX_SIZE) -> int:
            return r.per_layer(key, default, n_layers=n_layers, blocks=n_layers, layers=layers, low=low, high=high)

        kda = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        mla = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        if (gating := r.int("expert_gating_func", 2)) != 2:
            raise ModelLoadError(source, f"'{arch}.expert_gating_func' is {gating}; Kimi routes by sigmoid (2)")
        rope = num("rope.dimension_count", 0)
        dense_lead, n_experts = num("leading_dense_block_count", 0), num("expert_count", 0, high=MAX_EXPERTS)
        if vocab_size is None:
            vocab_size = r.int("vocab_size", 0) or len(top.items("tokenizer.ggml.tokens", str, []))
        eps = r.float("attention.layer_norm_rms_epsilon", low=0, high=1, open_low=True)
        return cls(
            vocab_size=vocab_size, hidden_size=num("embedding_length"),
            layer_types=tuple(layer_types),
            ffn_types=tuple("dense" if i < dense_lead or not n_experts else "moe" for i in range(n_layers)),
            rms_norm_eps=eps, conv_kernel=num("ssm.conv_kernel"),
            kda_heads=num("attention.head_count", layers=kda), kda_head_dim=num("kda.head_dim"),
            num_heads=num("attention.head_count", layers=mla), kv_lora_rank=num("attention.kv_lora_rank"),
            qk_nope_head_dim=num("attention.key_length_mla") - rope, qk_rope_head_dim=rope,
            v_head_dim=num("attention.value_length_mla"), q_lora_rank=num("attention.q_lora_rank", 0),
            mla_norm_eps=eps,  # llama.cpp's build_norm
            gate_lower_bound=r.float("kda.gate_lower_bound") if r.has("kda.gate_lower_bound") else None,
            intermediate_size=num("feed_forward_length", 0), num_experts=n_experts,
            num_experts_per_tok=num("expert_used_count", 0),
            moe_intermediate_size=num("expert_feed_forward_length", 0),
            num_shared_experts=num("expert_shared_count", 0),
            routed_scaling_factor=r.float("expert_weights_scale", 1.0, low=0, high=MAX_SCALE, open_low=True),
            norm_topk_prob=r.flag("expert_weights_norm", True),
            n_group=num("expert_group_count", 1) or 1, topk_group=num("expert_group_used_count", 1) or 1,
            tie_word_embeddings=tie_word_embeddings, max_position_embeddings=num("context_length", 0),
        )

    # ------------------------------------------------------------------ writing (the inverse of the readers)
    def to_hf(self) -> dict[str, Any]:
        """config.json as Moonshot released Kimi-Linear-48B-A3B (linear_attn_config, first_k_dense_replace);
        from_hf reads it back to an equal config."""
        dense = [i for i, t in enumerate(self.ffn_types) if t == "dense"]
        if dense != list(range(len(dense))):
            raise DeltaserveError("kimi_linear config.json can only say that the first k layers are dense")
        linear = {"kda_layers": [i + 1 for i, t in enumerate(self.layer_types) if t == "linear_attention"],
                  "full_attn_layers": [i + 1 for i, t in enumerate(self.layer_types) if t == "full_attention"],
                  "head_dim": self.kda_head_dim, "num_heads": self.kda_heads,
                  "short_conv_kernel_size": self.conv_kernel}
        if self.gate_lower_bound is not None:
            linear["gate_lower_bound"] = self.gate_lower_bound
        return {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_heads, "hidden_act": "silu",
            "kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank or None,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "mla_use_nope": True, "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_tok, "num_shared_experts": self.num_shared_experts,
            "moe_renormalize": self.norm_topk_prob, "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": self.routed_scaling_factor, "first_k_dense_replace": len(dense),
            "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": self.n_group,
            "topk_group": self.topk_group, "linear_attn_config": linear, "rms_norm_eps": self.rms_norm_eps,
            "model_max_length": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False, "dtype": "bfloat16",
        }

    def to_gguf(self, writer) -> None:
        """llama.cpp's kimi-linear metadata (a gguf.GGUFWriter; from_gguf reads it back). MLA is written as
        one kv head (MQA over the latent); a head_count_kv of 0 marks a KDA layer. Head counts go per layer
        where KDA and MLA layers differ in theirs."""
        import gguf

        w = writer
        w.add_block_count(self.num_layers)
        w.add_context_length(self.max_position_embeddings)
        w.add_embedding_length(self.hidden_size)
        w.add_feed_forward_length(self.intermediate_size)
        kda = [t == "linear_attention" for t in self.layer_types]
        w.add_head_count(self.num_heads if self.kda_heads == self.num_heads
                         else [self.kda_heads if r else self.num_heads for r in kda])
        w.add_head_count_kv([0 if t == "linear_attention" else 1 for t in self.layer_types])
        w.add_layer_norm_rms_eps(self.rms_norm_eps)
        w.add_expert_count(self.num_experts)
        w.add_expert_used_count(self.num_experts_per_tok)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(self.norm_topk_prob)
        w.add_vocab_size(self.vocab_size)
        w.add_ssm_conv_kernel(self.conv_kernel)
        w.add_kda_head_dim(self.kda_head_dim)
        w.add_kv_lora_rank(self.kv_lora_rank)
        if self.q_lora_rank:
            w.add_q_lora_rank(self.q_lora_rank)
        w.add_rope_dimension_count(self.qk_rope_head_dim)
        w.add_key_length(self.kv_lora_rank + self.qk_rope_head_dim)
        w.add_key_length_mla(self.qk_nope_head_dim + self.qk_rope_head_dim)
        w.add_value_length_mla(self.v_head_dim)
        w.add_expert_feed_forward_length(self.moe_intermediate_size)
        w.add_expert_shared_count(self.num_shared_experts)
        w.add_leading_dense_block_count(sum(t == "dense" for t in self.ffn_types))
        w.add_expert_weights_scale(self.routed_scaling_factor)
        if self.n_group > 1:
            w.add_expert_group_count(self.n_group)
            w.add_expert_group_used_count(self.topk_group)
        if self.gate_lower_bound is not None:
            w.add_float32("kimi-linear.kda.gate_lower_bound", self.gate_lower_bound)
