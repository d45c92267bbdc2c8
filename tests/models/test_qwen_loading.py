"""Loading quirks: GGUF files laid out the way llama.cpp's converter writes them, MTP blocks in both
formats, and clear errors for missing or mis-shaped tensors.

`write_gguf` below follows llama.cpp's convert_hf_to_gguf (conversion/qwen.py): norms stored + 1
(except the GDN output norm), ssm_a = -exp(A_log), Qwen3-Next's per-key-head qkvz split into attn_qkv /
attn_gate with ssm_ba kept as is, and for Qwen3.5 the value heads reordered from grouped to tiled.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from deltaserve.errors import ModelLoadError
from deltaserve.loader import open_checkpoint
from deltaserve.models import QwenModel

ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def write_gguf(tiny, path, *, alt: bool = False) -> None:
    """alt: the other layouts llama.cpp accepts (legacy ssm_in, fused attention qkv, fused expert
    gate_up, [1, E] shared-expert gate, explicit recurrent_layers array)."""
    cfg, arch = tiny.model.config, ARCH[tiny.family]
    sd = {k.removeprefix("model."): v.detach().float().clone() for k, v in tiny.model.state_dict().items()}
    E, H, HV, K, V = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    r, n_layers = HV // H, cfg.num_hidden_layers

    def tiled(t, dim, head):  # llama.cpp _reorder_v_heads: [H, r, head] -> [r, H, head] along dim
        if arch == "qwen3next":
            return t
        shape = t.shape
        return t.reshape(*shape[:dim], H, r, head, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)

    out = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"] + 1}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i, kind in enumerate(cfg.layer_types):
        src, b = f"layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[src + "input_layernorm.weight"] + 1
        out[b + "post_attention_norm.weight"] = sd[src + "post_attention_layernorm.weight"] + 1
        if kind == "linear_attention":
            a = src + "linear_attn."
            if arch == "qwen3next" and alt:
                out[b + "ssm_in.weight"] = sd[a + "in_proj_qkvz.weight"]
            elif arch == "qwen3next":
                per_head = sd[a + "in_proj_qkvz.weight"].T.reshape(E, H, 2 * K + 2 * r * V)
                q, k, v, z = (p.reshape(E, -1) for p in per_head.split([K, K, r * V, r * V], dim=-1))
                out[b + "attn_qkv.weight"] = torch.cat([q, k, v], dim=-1).T
                out[b + "attn_gate.weight"] = z.T
            if arch == "qwen3next":
                out[b + "ssm_ba.weight"] = sd[a + "in_proj_ba.weight"]
            else:
                q, k, v = sd[a + "in_proj_qkv.weight"].split([H * K, H * K, HV * V])
                out[b + "attn_qkv.weight"] = torch.cat([q, k, tiled(v, 0, V)])
                out[b + "attn_gate.weight"] = tiled(sd[a + "in_proj_z.weight"], 0, V)
                out[b + "ssm_beta.weight"] = tiled(sd[a + "in_proj_b.weight"], 0, 1)
                out[b + "ssm_alpha.weight"] = tiled(sd[a + "in_proj_a.weight"], 0, 1)
            qk, conv_v = sd[a + "conv1d.weight"].squeeze(1).split([2 * H * K, HV * V])
            out[b + "ssm_conv1d.weight"] = torch.cat([qk, tiled(conv_v, 0, V)])
            out[b + "ssm_a"] = tiled(-torch.exp(sd[a + "A_log"]), 0, 1)
            out[b + "ssm_dt.bias"] = tiled(sd[a + "dt_bias"], 0, 1)
            out[b + "ssm_norm.weight"] = sd[a + "norm.weight"]
            out[b + "ssm_out.weight"] = tiled(sd[a + "out_proj.weight"], 1, V)
        else:
            s = src + "self_attn."
            if alt:
                out[b + "attn_qkv.weight"] = torch.cat([sd[s + f"{x}_proj.weight"] for x in "qkv"])
            else:
                out.update({b + f"attn_{x}.weight": sd[s + f"{x}_proj.weight"] for x in "qkv"})
            out[b + "attn_output.weight"] = sd[s + "o_proj.weight"]
            out[b + "attn_q_norm.weight"] = sd[s + "q_norm.weight"] + 1
            out[b + "attn_k_norm.weight"] = sd[s + "k_norm.weight"] + 1
        m = src + "mlp."
        if tiny.family == "qwen3_5":
            out.update({b + f"ffn_{x}.weight": sd[m + f"{x}_proj.weight"] for x in ("gate", "up", "down")})
            continue
        out[b + "ffn_gate_inp.weight"] = sd[m + "gate.weight"]
        gate_up = sd[m + "experts.gate_up_proj"]  # transformers in memory: [n, 2I, E], gate rows first
        if alt:
            out[b + "ffn_gate_up_exps.weight"] = gate_up
        else:
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate_up.chunk(2, dim=1)
        out[b + "ffn_down_exps.weight"] = sd[m + "experts.down_proj"]
        out.update({b + f"ffn_{x}_shexp.weight": sd[m + f"shared_expert.{x}_proj.weight"]
                    for x in ("gate", "up", "down")})
        gate = sd[m + "shared_expert_gate.weight"]
        out[b + "ffn_gate_inp_shexp.weight"] = gate if alt else gate.reshape(E)
    # one MTP block after the trunk, as llama.cpp appends it; nothing of it may be read
    out[f"blk.{n_layers}.nextn.eh_proj.weight"] = torch.randn(E, 2 * E)
    out[f"blk.{n_layers}.attn_norm.weight"] = torch.full((E,), float("nan"))

    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", n_layers + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", E)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_uint32(f"{arch}.rope.dimension_count", int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    w.add_uint32(f"{arch}.ssm.state_size", K)
    w.add_uint32(f"{arch}.ssm.group_count", H)
    w.add_uint32(f"{arch}.ssm.time_step_rank", HV)
    w.add_uint32(f"{arch}.ssm.inner_size", HV * V)
    if alt:
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg.layer_types] + [False])
    else:
        w.add_uint32(f"{arch}.full_attention_interval", 4)
    if tiny.family == "qwen3_5":
        w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    else:
        w.add_uint32(f"{arch}.expert_count", cfg.num_experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    for name, t in out.items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy().astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_logits(tiny, ids):
    with torch.no_grad():
        return tiny.model(ids, use_cache=False).logits.float()


def run(model, ids):
    return model(ids, model.new_state(ids.shape[0], ids.shape[1]), list(range(ids.shape[0])), logits="all")


def rel_err(ours, ref):
    return float((ours - ref).abs().max() / ref.abs().max())


IDS = torch.randint(0, 307, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("alt", [False, True], ids=["llama.cpp-layout", "alternative-layouts"])
def test_gguf_matches_transformers(tiny, tmp_path, alt):
    path = tmp_path / "model.gguf"
    write_gguf(tiny, path, alt=alt)
    model = QwenModel.from_checkpoint(open_checkpoint(path))
    assert model.config.num_layers == 4 and model.config.mtp_layers == 1
    assert model.config.tie_word_embeddings == tiny.model.config.tie_word_embeddings
    assert rel_err(run(model, IDS), reference_logits(tiny, IDS)) < 1e-4


def test_mtp_tensors_in_hf_checkpoint_are_ignored(tiny, tmp_path):
    shutil.copytree(tiny.path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(72, 144)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.full((72,), float("nan"))
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = QwenModel.from_checkpoint(open_checkpoint(tmp_path))
    assert model.config.mtp_layers == 1
    assert rel_err(run(model, IDS), reference_logits(tiny, IDS)) < 1e-4


def test_bfloat16_weights_stay_close(tiny):
    model = QwenModel.from_checkpoint(open_checkpoint(tiny.path), dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.layers[0].input_norm.weight.dtype == torch.float32  # norms keep float32
    assert model.new_state(1, 4).ssm[0].dtype == torch.float32
    # bf16 rounding can flip a near-tied expert choice (transformers in bf16 does too), so the typical
    # error is the measure here: about 1% of the largest logit, for transformers in bf16 as for us
    ref = reference_logits(tiny, IDS)
    assert float((run(model, IDS) - ref).abs().median() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("damage", ["missing", "misshaped"])
def test_bad_tensor_is_a_clear_error(tiny, tmp_path, damage):
    shutil.copytree(tiny.path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.linear_attn.in_proj_a.weight" if tiny.family != "qwen3_next" else \
        "model.layers.2.linear_attn.in_proj_ba.weight"
    if damage == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        QwenModel.from_checkpoint(open_checkpoint(tmp_path))
    assert err.value.tensor == name and str(tmp_path) in str(err.value)
