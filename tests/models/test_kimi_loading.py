"""Kimi Linear loading: a GGUF written through the family's weight table (in each layout llama.cpp reads;
that they are what its converter writes is checked in tests/convert) loads to the same model as the
transformers directory and gives transformers' logits; config parsing; clear errors for missing or
mis-shaped tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import convert
from deltaserve.errors import ModelLoadError
from deltaserve.loader import open_checkpoint
from deltaserve.models import KimiModel
from deltaserve.models.kimi import KimiConfig
from tests.models.test_kimi_transformers import LIN, FULL, reference_logits, rel_err, tiny_kimi  # noqa: F401


def write_gguf(tiny, path, *, alt: bool = False) -> None:
    """The transformers checkpoint as a GGUF written through the family's weight table; alt: the older
    layouts llama.cpp also reads (kv_b_proj whole as attn_kv_b, as GGUFs from before the MLA cache split;
    one ffn_gate_up_exps, llama.cpp's --fuse-gate-up-exps)."""
    model = KimiModel.from_checkpoint(open_checkpoint(tiny.path))
    convert.write_gguf(path, model.config, model.state_dict(), None, "f32", option=-1 if alt else 0)


IDS = torch.randint(0, 307, (2, 13), generator=torch.Generator().manual_seed(9))


def run(model, ids=IDS):
    return model(ids, model.new_state(ids.shape[0], ids.shape[1]), list(range(ids.shape[0])), logits="all")


@pytest.mark.parametrize("layout", ["split-kv-b", "legacy-kv-b-fused-experts"])
def test_gguf_equals_hf_loading(tiny_kimi, tmp_path, layout):
    path = tmp_path / "model.gguf"
    write_gguf(tiny_kimi, path, alt=layout != "split-kv-b")
    from_gguf = KimiModel.from_checkpoint(open_checkpoint(path))
    from_hf = KimiModel.from_checkpoint(open_checkpoint(tiny_kimi.path))
    a, b = from_gguf.config, from_hf.config
    assert (a.layer_types, a.ffn_types, a.kda_heads, a.num_heads, a.q_lora_rank, a.n_group) == \
        (b.layer_types, b.ffn_types, b.kda_heads, b.num_heads, b.q_lora_rank, b.n_group)
    assert a.mla_norm_eps == a.rms_norm_eps == pytest.approx(1e-5)  # llama.cpp: the model's eps for the latent
    for name, p in from_hf.named_parameters():
        want = dict(from_gguf.named_parameters())[name]
        torch.testing.assert_close(want, p, rtol=1e-6, atol=0, msg=name)
    # only the latent norm's eps differs (1e-5 vs transformers' 1e-6): a few 1e-6 of the logits
    got, ref = run(from_gguf), reference_logits(tiny_kimi, IDS)
    assert rel_err(got, ref) < 1e-4 and rel_err(run(from_hf), ref) < 1e-4


def test_transformers_in_memory_names_load(tiny_kimi, tmp_path):
    """The names transformers holds in memory (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj)."""
    state = {k: v.detach().clone().contiguous() for k, v in tiny_kimi.model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(f"{tiny_kimi.path}/config.json", tmp_path / "config.json")
    assert "model.layers.0.self_attn.conv1d.weight" in state and "model.layers.0.mlp.gate_proj.weight" in state
    model = KimiModel.from_checkpoint(open_checkpoint(tmp_path))
    assert rel_err(run(model), reference_logits(tiny_kimi, IDS)) < 1e-4


@pytest.mark.parametrize("damage", ["missing", "misshaped"])
def test_bad_tensor_is_a_clear_error(tiny_kimi, tmp_path, damage):
    shutil.copytree(tiny_kimi.path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.3.self_attn.f_b_proj.weight"
    if damage == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        KimiModel.from_checkpoint(open_checkpoint(tmp_path))
    assert err.value.tensor == name and str(tmp_path) in str(err.value)


# -- config ---------------------------------------------------------------------------------------

def released_config() -> dict:
    """Shaped like moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json, at a small size."""
    return {
        "model_type": "kimi_linear", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32,
        "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
        "model_max_length": 1048576, "tie_word_embeddings": False, "mla_use_nope": True,
        "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "head_dim": 16,
                               "num_heads": 4, "short_conv_kernel_size": 4},
    }


def test_released_config():
    cfg = KimiConfig.from_hf(released_config())
    assert cfg.layer_types == (LIN, LIN, LIN, FULL) * 2  # 1-based full_attn_layers 4 and 8
    assert cfg.ffn_types == ("dense",) + ("moe",) * 7
    assert (cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel, cfg.kda_dim) == (4, 16, 4, 64)
    assert (cfg.q_lora_rank, cfg.shared_intermediate_size, cfg.max_position_embeddings) == (0, 32, 1048576)
    assert cfg.gate_lower_bound is None and cfg.num_experts_per_tok == 2


@pytest.mark.parametrize("change, problem", [
    ({"moe_router_activation_func": "softmax"}, "only sigmoid"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4]}}, "do not cover"),
    ({"num_experts_per_token": 9}, r"num_experts_per_tok \(9\)"),
    ({"num_expert_group": 3}, "8 experts cannot form 3 groups"),
    ({"model_type": "qwen3_next"}, "not 'kimi_linear'"),
], ids=["router", "layers", "top-k", "groups", "model-type"])
def test_bad_config_is_a_clear_error(change, problem):
    with pytest.raises(ModelLoadError, match=problem):
        KimiConfig.from_hf(released_config() | change, "cfg.json")


def test_gguf_metadata_errors():
    base = {"general.architecture": "kimi-linear", "kimi-linear.block_count": 2,
            "kimi-linear.attention.head_count_kv": [0, 1], "kimi-linear.expert_gating_func": 1}
    with pytest.raises(ModelLoadError, match="sigmoid"):
        KimiConfig.from_gguf(base, "m.gguf", vocab_size=10)
    with pytest.raises(ModelLoadError, match="must list every layer"):
        KimiConfig.from_gguf(base | {"kimi-linear.attention.head_count_kv": 1}, "m.gguf", vocab_size=10)


def test_hf_config_json_round_trip(tiny_kimi):
    """The config.json transformers wrote (its attribute-mapped names) reads back to the same numbers."""
    raw = json.loads(open(f"{tiny_kimi.path}/config.json").read())
    cfg = KimiConfig.from_hf(raw)
    assert cfg.num_experts == 6 and cfg.num_experts_per_tok == 2 and cfg.kda_heads == 3
    assert cfg.n_group == raw.get("num_expert_group", 1) and cfg.num_shared_experts == raw["num_shared_experts"]
