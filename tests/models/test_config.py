"""QwenConfig from transformers configs and GGUF metadata; expected values worked out by hand."""

from __future__ import annotations

import pytest

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.models.qwen import QwenConfig

LIN, FULL = "linear_attention", "full_attention"


def qwen35_vl_config() -> dict:
    """Shaped like a published Qwen3.5 config.json: the LM nested under text_config, mrope, MTP."""
    return {
        "model_type": "qwen3_5", "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 96, "num_hidden_layers": 8,
            "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 160,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24,
            "linear_num_key_heads": 2, "linear_num_value_heads": 6, "rms_norm_eps": 1e-6,
            "full_attention_interval": 4, "mtp_num_hidden_layers": 1, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        },
    }


def test_from_hf_nested_qwen35():
    cfg = QwenConfig.from_hf(qwen35_vl_config())
    assert cfg.arch == "qwen35" and cfg.num_layers == 8
    assert cfg.layer_types == (LIN, LIN, LIN, FULL) * 2
    assert cfg.ffn_types == ("dense",) * 8
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.head_dim) == (8, 1e7, 32)
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim) == (2, 6, 16, 24)
    assert cfg.conv_dim == 2 * 2 * 16 + 6 * 24
    assert cfg.tie_word_embeddings and cfg.mtp_layers == 1 and cfg.max_position_embeddings == 262144


def test_from_hf_qwen3_next_legacy_keys_and_dense_layers():
    raw = {
        "model_type": "qwen3_next", "vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "rope_theta": 5e6, "partial_rotary_factor": 0.5,
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "mlp_only_layers": [3],
    }
    cfg = QwenConfig.from_hf(raw)
    assert cfg.arch == "qwen3next" and cfg.head_dim == 16 and cfg.rotary_dim == 8 and cfg.rope_theta == 5e6
    # MoE where (i + 1) % 2 == 0 and i not in mlp_only_layers: only layer 1
    assert cfg.ffn_types == ("dense", "moe", "dense", "dense")
    assert cfg.norm_topk_prob is False and not cfg.tie_word_embeddings


def test_from_hf_errors_name_the_problem():
    raw = qwen35_vl_config()
    raw["text_config"]["linear_num_value_heads"] = 5
    with pytest.raises(ModelLoadError, match=r"cfg\.json.*value heads \(5\).*key heads \(2\)"):
        QwenConfig.from_hf(raw, source="cfg.json")
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        QwenConfig.from_hf({"model_type": "llama"})
    raw = qwen35_vl_config()
    raw["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        QwenConfig.from_hf(raw)
    raw = qwen35_vl_config()
    del raw["text_config"]["vocab_size"]
    with pytest.raises(ModelLoadError, match="vocab_size"):
        QwenConfig.from_hf(raw)


def test_constructor_validates():
    base = QwenConfig.from_hf(qwen35_vl_config())
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(DeltaserveError, match="rotary_dim"):
        QwenConfig(**{**fields, "rotary_dim": 7})
    with pytest.raises(DeltaserveError, match="num_heads"):
        QwenConfig(**{**fields, "num_kv_heads": 4})
    with pytest.raises(DeltaserveError, match="unknown layer types"):
        QwenConfig(**{**fields, "layer_types": ("mamba",) * 8})


def gguf_metadata() -> dict:
    a = "qwen35moe"
    return {
        "general.architecture": a, f"{a}.block_count": 5, f"{a}.nextn_predict_layers": 1,
        f"{a}.context_length": 8192, f"{a}.embedding_length": 64,
        f"{a}.attention.head_count": [0, 4, 0, 4, 4], f"{a}.attention.head_count_kv": [0, 2, 0, 2, 2],
        f"{a}.attention.key_length": 32, f"{a}.attention.value_length": 32,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.rope.freq_base": 1e7, f"{a}.rope.dimension_count": 8,
        f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.state_size": 16, f"{a}.ssm.group_count": 2,
        f"{a}.ssm.time_step_rank": 4, f"{a}.ssm.inner_size": 80,
        f"{a}.attention.recurrent_layers": [True, False, True, False, False],
        f"{a}.expert_count": 8, f"{a}.expert_used_count": 2, f"{a}.expert_feed_forward_length": 24,
        f"{a}.expert_shared_feed_forward_length": 40,
        "tokenizer.ggml.tokens": ["t"] * 700,
    }


def test_from_gguf():
    cfg = QwenConfig.from_gguf(gguf_metadata(), tie_word_embeddings=True)
    assert cfg.arch == "qwen35moe" and cfg.num_layers == 4 and cfg.mtp_layers == 1
    assert cfg.layer_types == (LIN, FULL, LIN, FULL)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (4, 2, 32, 8)
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim) == (2, 4, 16, 20)
    assert cfg.ffn_types == ("moe",) * 4 and cfg.shared_expert_intermediate_size == 40
    assert cfg.vocab_size == 700 and cfg.tie_word_embeddings
    assert QwenConfig.from_gguf(gguf_metadata(), vocab_size=704).vocab_size == 704

    meta = gguf_metadata()
    del meta["qwen35moe.attention.recurrent_layers"]  # interval 4 by default: layer 3 is attention
    assert QwenConfig.from_gguf(meta).layer_types == (LIN, LIN, LIN, FULL)


def test_from_gguf_errors():
    meta = gguf_metadata()
    meta["qwen35moe.attention.head_count_kv"] = [0, 2, 0, 1, 1]
    with pytest.raises(ModelLoadError, match="head_count_kv' differs"):
        QwenConfig.from_gguf(meta, source="m.gguf")
    meta = gguf_metadata()
    del meta["qwen35moe.ssm.state_size"]
    with pytest.raises(ModelLoadError, match="m.gguf.*qwen35moe.ssm.state_size"):
        QwenConfig.from_gguf(meta, source="m.gguf")
    with pytest.raises(ModelLoadError, match="'llama'"):
        QwenConfig.from_gguf({"general.architecture": "llama"})
