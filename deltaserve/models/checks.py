"""Checks every hybrid family's config makes of itself (no torch here: configs are read by tools that
must start fast). Each raises DeltaserveError naming the field and the value."""

from __future__ import annotations

from deltaserve.errors import DeltaserveError

LAYER_TYPES = ("linear_attention", "full_attention")
FFN_TYPES = ("dense", "moe")


def check_hybrid(cfg, what: str, positive: tuple[str, ...]) -> None:
    """The fields named in `positive` are positive integers; layer_types / ffn_types are known, one per layer;
    dense layers have a width; MoE layers have experts, a width and a top-k within them."""
    def bad(problem: str):
        raise DeltaserveError(f"invalid {what} config: {problem}")

    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            bad(f"{name} must be a positive integer, got {value!r}")
    if not cfg.layer_types:
        bad("the model has no layers")
    if unknown := set(cfg.layer_types) - set(LAYER_TYPES):
        bad(f"unknown layer types {sorted(map(str, unknown))}; expected {LAYER_TYPES}")
    if len(cfg.ffn_types) != len(cfg.layer_types):
        bad(f"{len(cfg.ffn_types)} ffn types for {len(cfg.layer_types)} layers")
    if unknown := set(cfg.ffn_types) - set(FFN_TYPES):
        bad(f"unknown ffn types {sorted(map(str, unknown))}; expected {FFN_TYPES}")
    if cfg.conv_kernel < 2:
        bad(f"conv_kernel ({cfg.conv_kernel}) must be at least 2")
    if "dense" in cfg.ffn_types and cfg.intermediate_size <= 0:
        bad(f"dense layers need intermediate_size > 0, got {cfg.intermediate_size}")
    if "moe" in cfg.ffn_types:
        if cfg.num_experts <= 0 or cfg.moe_intermediate_size <= 0:
            bad(f"MoE layers need num_experts ({cfg.num_experts}) and moe_intermediate_size "
                f"({cfg.moe_intermediate_size}) > 0")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            bad(f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in [1, num_experts={cfg.num_experts}]")
