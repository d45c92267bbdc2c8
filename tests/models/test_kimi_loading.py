"""Kimi Linear loading: a GGUF written the way llama.cpp's converter writes it (conversion/kimi_linear.py:
names from gguf-py's tensor map, ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, convs as [1, C, 1, W],
kv_b_proj split into attn_k_b (transposed) and attn_v_b, experts stacked) loads to the same model as the
transformers directory; config parsing; clear errors for missing or mis-shaped tensors."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.errors import ModelLoadError
from deltaserve.loader import open_checkpoint
from deltaserve.models import KimiModel
from deltaserve.models.kimi import KimiConfig
from tests.models.test_kimi_transformers import LIN, FULL, reference_logits, rel_err, tiny_kimi  # noqa: F401


def write_gguf(tiny, path, *, legacy_kv_b: bool = False, fused_experts: bool = False) -> None:
    """legacy_kv_b: keep kv_b_proj whole (attn_kv_b), as GGUFs from before the MLA cache split;
    fused_experts: one ffn_gate_up_exps (llama.cpp's --fuse-gate-up-exps)."""
    cfg = tiny.model.config
    sd = load_file(f"{tiny.path}/model.safetensors")  # Moonshot's names, as the converter reads them
    n_layers, E = cfg.num_hidden_layers, cfg.hidden_size
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_LINEAR, n_layers)
    nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    out, experts = {}, {}
    for name, t in sd.items():
        t = t.float()
        if ".experts." in name:  # model.layers.{i}.block_sparse_moe.experts.{j}.w{1,2,3}.weight
            layer, _, _, j, w, _ = name.split(".")[2:]
            experts.setdefault((int(layer), w), {})[int(j)] = t
            continue
        if name.endswith("_conv1d.weight"):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        if name.endswith(".dt_bias"):
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        if name.endswith("e_score_correction_bias"):
            name = name.removesuffix("_bias") + ".bias"
        if name.endswith("kv_b_proj.weight") and not legacy_kv_b:
            k_b, v_b = t.view(nh, dn + dv, -1).split([dn, dv], dim=1)
            out[names.get_name(name.replace("kv_b", "k_b"), try_suffixes=(".weight",))] = k_b.transpose(1, 2)
            out[names.get_name(name.replace("kv_b", "v_b"), try_suffixes=(".weight",))] = v_b
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and ".block_sparse_moe." in name:  # transformers saves dense MLPs under this name too
            gguf_name = names.get_name(name.replace(".block_sparse_moe.", ".mlp."), try_suffixes=(".weight",))
        assert gguf_name is not None, name
        out[gguf_name] = t
    for (layer, w), by_id in experts.items():
        out[f"blk.{layer}.ffn_{dict(w1='gate', w2='down', w3='up')[w]}_exps.weight"] = \
            torch.stack([by_id[j] for j in range(len(by_id))])
    if fused_experts:
        for layer in range(n_layers):
            if f"blk.{layer}.ffn_gate_exps.weight" in out:
                out[f"blk.{layer}.ffn_gate_up_exps.weight"] = torch.cat(
                    [out.pop(f"blk.{layer}.ffn_gate_exps.weight"), out.pop(f"blk.{layer}.ffn_up_exps.weight")], dim=1)

    arch = "kimi-linear"
    kda = [t == LIN for t in cfg.layer_types]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(E)
    w.add_feed_forward_length(cfg.intermediate_size)
    # llama.cpp sizes KDA and MLA layers by one head count; ours differ, so give it per layer
    w.add_head_count([cfg.linear_num_heads if r else nh for r in kda])
    w.add_head_count_kv([0 if r else 1 for r in kda])  # the converter makes MLA one kv head (MQA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_kda_head_dim(cfg.linear_head_dim)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_key_length_mla(dn + cfg.qk_rope_head_dim)
    w.add_value_length_mla(dv)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.mlp_layer_types.count("dense"))
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.n_group > 1:
        w.add_uint32(f"{arch}.expert_group_count", cfg.n_group)
        w.add_uint32(f"{arch}.expert_group_used_count", cfg.topk_group)
    for name, t in out.items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


IDS = torch.randint(0, 307, (2, 13), generator=torch.Generator().manual_seed(9))


def run(model, ids=IDS):
    return model(ids, model.new_state(ids.shape[0], ids.shape[1]), list(range(ids.shape[0])), logits="all")


@pytest.mark.parametrize("layout", ["split-kv-b", "legacy-kv-b-fused-experts"])
def test_gguf_equals_hf_loading(tiny_kimi, tmp_path, layout):
    path = tmp_path / "model.gguf"
    write_gguf(tiny_kimi, path, legacy_kv_b=layout != "split-kv-b", fused_experts=layout != "split-kv-b")
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
