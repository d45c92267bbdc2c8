"""The shape of a Kimi Linear model, read from (and written to) either format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.models.checks import check_hybrid


KIMI_ARCH = "kimi-linear"


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
    def from_hf(cls, config: Mapping[str, Any], source: str = "config.json") -> KimiConfig:
        """Read a kimi_linear config.json, as Moonshot released it (linear_attn_config, first_k_dense_replace)
        or as transformers saves it (layer_types, mlp_layer_types, linear_* keys)."""
        if config.get("model_type") != "kimi_linear":
            raise ModelLoadError(source, f"model_type {config.get('model_type')!r} is not 'kimi_linear'")

        def need(*keys: str):
            for key in keys:
                if key in config:
                    return config[key]
            raise ModelLoadError(source, f"missing config key {keys[0]!r}")

        def opt(default: Any, *keys: str):
            return next((config[k] for k in keys if config.get(k) is not None), default)

        if config.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(source, f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("attention_bias", False):
            raise ModelLoadError(source, "attention_bias=true is not supported")
        if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ModelLoadError(source, f"moe_router_activation_func {config['moe_router_activation_func']!r} "
                                         "is not supported (only sigmoid)")
        linear = dict(config.get("linear_attn_config") or {})
        n_layers = need("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None and "kda_layers" in linear and "full_attn_layers" in linear:
            kda = set(linear["kda_layers"])  # 1-based layer numbers
            layer_types = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n_layers)]
            if kda | set(linear["full_attn_layers"]) != set(range(1, n_layers + 1)):
                raise ModelLoadError(source, f"linear_attn_config kda_layers / full_attn_layers do not cover "
                                             f"layers 1..{n_layers}")
        if layer_types is None:
            raise ModelLoadError(source, "missing layer_types (or linear_attn_config kda_layers / full_attn_layers)")
        if len(layer_types) != n_layers:
            raise ModelLoadError(source, f"layer_types has {len(layer_types)} entries for {n_layers} layers")

        n_experts = opt(0, "num_experts", "num_local_experts", "n_routed_experts")
        ffn_types = config.get("mlp_layer_types")
        if ffn_types is not None:
            ffn_types = ["moe" if t == "sparse" else t for t in ffn_types]
        else:  # Moonshot's rule: the first k layers dense, then MoE every moe_layer_freq-th layer
            first, freq = opt(1, "first_k_dense_replace"), opt(1, "moe_layer_freq")
            ffn_types = ["moe" if n_experts and i >= first and i % freq == 0 else "dense" for i in range(n_layers)]
        lower = linear.get("gate_lower_bound")
        if lower is None and linear.get("safe_gate", False):
            lower = -5.0  # fla's default bound for the safe gate
        try:
            return cls(
                vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                layer_types=tuple(layer_types), ffn_types=tuple(ffn_types),
                rms_norm_eps=float(opt(1e-5, "rms_norm_eps")),
                conv_kernel=int(linear.get("short_conv_kernel_size", opt(4, "linear_conv_kernel_dim"))),
                kda_heads=int(linear.get("num_heads", opt(32, "linear_num_heads"))),
                kda_head_dim=int(linear.get("head_dim", opt(128, "linear_head_dim"))),
                num_heads=need("num_attention_heads"), kv_lora_rank=need("kv_lora_rank"),
                qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
                v_head_dim=need("v_head_dim"), q_lora_rank=opt(0, "q_lora_rank"),
                mla_norm_eps=1e-6,  # transformers and Moonshot's code build these norms with the default eps
                gate_lower_bound=None if lower is None else float(lower),
                intermediate_size=opt(0, "intermediate_size"), num_experts=n_experts,
                num_experts_per_tok=opt(0, "num_experts_per_token", "num_experts_per_tok"),
                moe_intermediate_size=opt(0, "moe_intermediate_size"),
                num_shared_experts=opt(0, "num_shared_experts", "n_shared_experts"),
                routed_scaling_factor=float(opt(1.0, "routed_scaling_factor")),
                norm_topk_prob=bool(opt(True, "moe_renormalize", "norm_topk_prob")),
                n_group=opt(1, "num_expert_group", "n_group"), topk_group=opt(1, "topk_group"),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=opt(0, "model_max_length", "max_position_embeddings"),
            )
        except DeltaserveError as e:
            raise ModelLoadError(source, str(e)) from None

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str = "gguf", *, vocab_size: int | None = None,
                  tie_word_embeddings: bool = False) -> KimiConfig:
        """Read llama.cpp `kimi-linear` metadata: KDA layers are those with attention.head_count_kv 0, and
        both layer kinds take their head count from attention.head_count (per layer when an array)."""
        arch = metadata.get("general.architecture")
        if arch != KIMI_ARCH:
            raise ModelLoadError(source, f"general.architecture {arch!r} is not {KIMI_ARCH!r}")

        def get(key: str, default: Any = None):
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(source, f"missing metadata key '{arch}.{key}'")
            return value

        n_layers = int(get("block_count"))
        kv_heads = get("attention.head_count_kv")
        if not isinstance(kv_heads, (list, tuple)) or len(kv_heads) < n_layers:
            raise ModelLoadError(source, f"'{arch}.attention.head_count_kv' must list every layer (0 marks a "
                                         f"KDA layer), got {kv_heads!r}")
        layer_types = ["linear_attention" if int(n) == 0 else "full_attention" for n in list(kv_heads)[:n_layers]]

        def num(key: str, default: Any = None, layers: list[int] | None = None) -> int:
            value = get(key, default)
            if isinstance(value, (list, tuple)):
                values = {int(value[i]) for i in (layers or range(n_layers))}
                if len(values) != 1:
                    raise ModelLoadError(source, f"'{arch}.{key}' differs between layers: {list(value)}")
                return values.pop()
            return int(value)

        kda = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        mla = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        if (gating := int(get("expert_gating_func", 2))) != 2:
            raise ModelLoadError(source, f"'{arch}.expert_gating_func' is {gating}; Kimi routes by sigmoid (2)")
        rope = num("rope.dimension_count", 0)
        dense_lead, n_experts = num("leading_dense_block_count", 0), num("expert_count", 0)
        if vocab_size is None:
            vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
        lower = metadata.get(f"{arch}.kda.gate_lower_bound")
        try:
            return cls(
                vocab_size=int(vocab_size), hidden_size=num("embedding_length"),
                layer_types=tuple(layer_types),
                ffn_types=tuple("dense" if i < dense_lead or not n_experts else "moe" for i in range(n_layers)),
                rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
                conv_kernel=num("ssm.conv_kernel"),
                kda_heads=num("attention.head_count", layers=kda), kda_head_dim=num("kda.head_dim"),
                num_heads=num("attention.head_count", layers=mla), kv_lora_rank=num("attention.kv_lora_rank"),
                qk_nope_head_dim=num("attention.key_length_mla") - rope, qk_rope_head_dim=rope,
                v_head_dim=num("attention.value_length_mla"), q_lora_rank=num("attention.q_lora_rank", 0),
                mla_norm_eps=float(get("attention.layer_norm_rms_epsilon")),  # llama.cpp's build_norm
                gate_lower_bound=None if lower is None else float(lower),
                intermediate_size=num("feed_forward_length", 0), num_experts=n_experts,
                num_experts_per_tok=num("expert_used_count", 0),
                moe_intermediate_size=num("expert_feed_forward_length", 0),
                num_shared_experts=num("expert_shared_count", 0),
                routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(get("expert_weights_norm", True)),
                n_group=num("expert_group_count", 1) or 1, topk_group=num("expert_group_used_count", 1) or 1,
                tie_word_embeddings=tie_word_embeddings, max_position_embeddings=num("context_length", 0),
            )
        except DeltaserveError as e:
            raise ModelLoadError(source, str(e)) from None

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
