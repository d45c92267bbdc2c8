"""Config values from untrusted checkpoints: each malformed value is one ModelLoadError naming the file, the key
and the value, raised before anything is built from it (no 1e8-entry lists, no ZeroDivisionError, TypeError,
IndexError or AttributeError from deep inside a reader)."""

from __future__ import annotations

import json
import re
import resource
import shutil
import time

import pytest
import torch

from deltaserve.convert import make_model
from deltaserve.errors import ModelLoadError
from deltaserve.loader import open_checkpoint
from deltaserve.models import KimiConfig, QwenConfig, load_model
from deltaserve.models.checks import MAX_LAYERS, reads_config

from ..loader import gguf_edit
from ..loader.gguf_edit import V, Value
from .test_config import gguf_metadata, qwen35_vl_config

A = "qwen35moe"  # gguf_metadata()'s architecture: 5 blocks, the last one MTP


def gguf_error(change: dict, remove: tuple[str, ...] = (), **kwargs) -> str:
    meta = gguf_metadata() | change
    for key in remove:
        del meta[key]
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as error:
        QwenConfig.from_gguf(meta, source="m.gguf", **kwargs)
    assert time.monotonic() - start < 0.5
    assert str(error.value).startswith("m.gguf: ")
    return str(error.value)


@pytest.mark.parametrize("count", [10**8, 2**32, 2**62])
def test_huge_block_count(count):
    assert f"'{A}.block_count' must be in [1, {MAX_LAYERS}], got {count}" in gguf_error({f"{A}.block_count": count})


def test_block_count_bounded_by_the_blocks_in_the_file():
    assert f"'{A}.block_count' asks for 7 layers, but the checkpoint holds tensors for 4" in gguf_error(
        {f"{A}.block_count": 8, f"{A}.attention.recurrent_layers": [True] * 8}, max_layers=4)


@pytest.mark.parametrize("key, value, message", [
    ("attention.head_count", 0, r"'qwen35moe.attention.head_count' must be in \[1, \d+\], got 0"),
    ("ssm.time_step_rank", 0, r"'qwen35moe.ssm.time_step_rank' must be in \[1, \d+\], got 0"),
    ("embedding_length", 0, r"'qwen35moe.embedding_length' must be in \[1, \d+\], got 0"),
    ("attention.head_count", [0, 0, 0, 0, 0], r"'qwen35moe.attention.head_count' must be in \[1, \d+\], got 0"),
    ("nextn_predict_layers", 5, r"'qwen35moe.nextn_predict_layers' must be in \[0, 4\], got 5"),
    ("expert_count", 10**6, r"'qwen35moe.expert_count' must be in \[0, 1024\], got 1000000"),
    ("attention.layer_norm_rms_epsilon", 0.0, r"epsilon' must be a finite number in \(0, 1\], got 0.0"),
    ("attention.layer_norm_rms_epsilon", float("nan"), r"epsilon' must be a finite number in \(0, 1\], got nan"),
    ("rope.freq_base", float("inf"), r"'qwen35moe.rope.freq_base' must be a finite number in \(0, inf\], got inf"),
])
def test_zero_and_out_of_range_values(key, value, message):
    assert re.search(message, gguf_error({f"{A}.{key}": value}))


def test_zero_full_attention_interval():
    assert f"'{A}.full_attention_interval' must be in [1, " in gguf_error(
        {f"{A}.full_attention_interval": 0}, remove=(f"{A}.attention.recurrent_layers",))


@pytest.mark.parametrize("key, value, message", [
    ("general.architecture", [A], f"general.architecture ['{A}'] is not one of"),
    (f"{A}.attention.recurrent_layers", 5, f"'{A}.attention.recurrent_layers' must be a list, got 5 (int)"),
    (f"{A}.attention.recurrent_layers", [True, 2, 0, 1, 1], "must list bool values, but entry 1 is 2 (int)"),
    (f"{A}.attention.head_count", [0, 4], f"'{A}.attention.head_count' must have 4 to 5 entries, got 2"),
    (f"{A}.attention.head_count_kv", [0, "2", 0, 2, 2], "must list int values, but entry 1 is '2' (str)"),
    (f"{A}.block_count", 5.0, f"'{A}.block_count' must be an integer, got 5.0 (float)"),
    (f"{A}.block_count", True, f"'{A}.block_count' must be an integer, got True (bool)"),
    (f"{A}.block_count", "5", f"'{A}.block_count' must be an integer, got '5' (str)"),
    (f"{A}.embedding_length", [64, 64], f"'{A}.embedding_length' must have 4 to 5 entries, got 2"),
    (f"{A}.attention.layer_norm_rms_epsilon", "1e-6", "epsilon' must be a number, got '1e-6' (str)"),
    (f"{A}.expert_weights_norm", "yes", f"'{A}.expert_weights_norm' must be true or false, got 'yes' (str)"),
    ("tokenizer.ggml.tokens", 700, "'tokenizer.ggml.tokens' must be a list, got 700 (int)"),
])
def test_values_of_the_wrong_type(key, value, message):
    assert message in gguf_error({key: value})


def test_kimi_gguf_values():
    meta = {"general.architecture": "kimi-linear", "kimi-linear.block_count": 2**32}
    with pytest.raises(ModelLoadError, match=r"'kimi-linear.block_count' must be in \[1, 1024\], got 4294967296"):
        KimiConfig.from_gguf(meta, source="k.gguf")
    meta["kimi-linear.block_count"] = 4
    meta["kimi-linear.attention.head_count_kv"] = 1
    with pytest.raises(ModelLoadError, match=r"head_count_kv' must list every layer \(0 marks a KDA layer\), got 1"):
        KimiConfig.from_gguf(meta, source="k.gguf")


def hf_error(change: dict, config: dict | None = None, cls=QwenConfig, **kwargs) -> str:
    raw = config if config is not None else qwen35_vl_config()
    target = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    target.update(change)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as error:
        cls.from_hf(raw, source="config.json", **kwargs)
    assert time.monotonic() - start < 0.5
    return str(error.value)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 1e8}, "'text_config.num_hidden_layers' must be an integer, got 100000000.0 (float)"),
    ({"num_hidden_layers": 10**8}, f"'text_config.num_hidden_layers' must be in [1, {MAX_LAYERS}], got 100000000"),
    ({"num_attention_heads": 0, "head_dim": None}, "'text_config.num_attention_heads' must be in [1, "),
    ({"full_attention_interval": 0}, "'text_config.full_attention_interval' must be in [1, "),
    ({"rope_parameters": [1e7]}, "'text_config.rope_parameters' must be an object, got [10000000.0] (list)"),
    ({"layer_types": 3}, "'text_config.layer_types' must be a list, got 3 (int)"),
    ({"layer_types": ["linear_attention"] * 3}, "'text_config.layer_types' must have 8 entries, got 3"),
    ({"hidden_act": ["silu"]}, "'text_config.hidden_act' must be a string, got ['silu'] (list)"),
    ({"rms_norm_eps": -1e-6}, "'text_config.rms_norm_eps' must be a finite number in (0, 1], got -1e-06"),
])
def test_hf_values(change, message):
    assert message in hf_error(change)


def test_hf_layer_count_bounded_by_the_checkpoint():
    assert "'text_config.num_hidden_layers' asks for 8 layers, but the checkpoint holds tensors for 4" in hf_error(
        {}, max_layers=4)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen3_5", "text_config": ["x"]}, "'text_config' must be an object, got ['x'] (list)"),
    ({"model_type": ["qwen3_5"]}, "model_type ['qwen3_5'] is not a Qwen hybrid model"),
    (["qwen3_5"], "the config must be a mapping of keys to values, got ['qwen3_5'] (list)"),
])
def test_hf_top_level_shapes(config, message):
    with pytest.raises(ModelLoadError) as error:
        QwenConfig.from_hf(config, source="config.json")
    assert message in str(error.value)


def test_qwen3_next_zero_sparse_step():
    raw = {"model_type": "qwen3_next", "vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "decoder_sparse_step": 0}
    assert "'decoder_sparse_step' must be in [1, " in hf_error({}, config=raw)


@pytest.mark.parametrize("change, message", [
    ({"moe_layer_freq": 0}, "'moe_layer_freq' must be in [1, "),
    ({"num_expert_group": 0}, "'num_expert_group' must be in [1, "),
    ({"linear_attn_config": [1]}, "'linear_attn_config' must be an object"),
    ({"linear_attn_config": {"kda_layers": ["1"], "full_attn_layers": [2]}},
     "'linear_attn_config.kda_layers' must list int values, but entry 0 is '1' (str)"),
])
def test_kimi_hf_values(change, message):
    raw = {"model_type": "kimi_linear", "vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
           "v_head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
           "num_experts_per_token": 2, "moe_intermediate_size": 16}
    if "linear_attn_config" in change:
        del raw["layer_types"]
    assert message in hf_error(change, config=raw, cls=KimiConfig)


def test_the_last_line_of_defence_names_the_file_and_the_exception():
    class Reader:
        @classmethod
        @reads_config("config.json")
        def from_hf(cls, values, source="config.json"):
            return 1 // values["zero"]

    with pytest.raises(ModelLoadError, match=r"^c\.json: malformed config \(ZeroDivisionError: integer division"):
        Reader.from_hf({"zero": 0}, source="c.json")
    with pytest.raises(ModelLoadError, match=r"^config\.json: malformed config \(KeyError: 'zero'\)"):
        Reader.from_hf({})


# -- whole files: the header against the tensors it describes ------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted-config")
    return make_model("qwen35", "tiny", "f32", root / "tiny.gguf", hf_dir=root / "hf")


def edited_gguf(tiny, tmp_path, **values) -> str:
    image = gguf_edit.read(tiny.gguf_path)
    for key, value in values.items():
        image.metadata[f"qwen35.{key}"] = value
    return str(gguf_edit.write(image, tmp_path / "edited.gguf"))


@pytest.mark.parametrize("count", [10**8, 2**32 - 1, 2**62])
def test_a_huge_block_count_in_a_file_fails_fast_and_small(tiny, tmp_path, count):
    path = edited_gguf(tiny, tmp_path, block_count=Value(V.UINT64, count))
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"edited\.gguf: 'qwen35.block_count' must be in \[1, 1024\], got {count}"):
        load_model(open_checkpoint(path))
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


@pytest.mark.parametrize("values, message", [
    ({"block_count": Value(V.UINT32, 8)}, "'qwen35.block_count' asks for 8 layers, but the checkpoint holds tensors for 4"),
    ({"block_count": Value(V.UINT32, 3)}, r"tensor 'blk.3.attn_norm.weight': tensor not read by a model of 3 layers"),
    ({"nextn_predict_layers": Value(V.UINT32, 1)},
     "block 3 is counted as a next-token-prediction block, but holds no nextn.* tensors"),
    ({"embedding_length": Value(V.UINT32, 2**30)},
     r"tensor 'token_embd.weight': expected shape \(\d+, 1073741824\) \(from the config\), found \(\d+, 96\)"),
    ({"full_attention_interval": Value(V.UINT32, 2)}, r"tensor 'blk.1.attn_qkv.weight': expected shape \(1024, 96\)"),
])
def test_a_header_that_disagrees_with_the_tensors(tiny, tmp_path, values, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(open_checkpoint(edited_gguf(tiny, tmp_path, **values)))


def test_an_hf_config_with_fewer_layers_than_the_checkpoint(tiny, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, hf)
    config = json.loads((hf / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 3, config["layer_types"][:3]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"the config has 3 layers, but the checkpoint holds tensors of layer 3"):
        load_model(open_checkpoint(hf))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A tiny qwen35moe with its own output head (not tied), as a transformers directory."""
    root = tmp_path_factory.mktemp("untied")
    return make_model("qwen35moe", "tiny", "f32", root / "moe.gguf", hf_dir=root / "hf")


def edited_hf(made, tmp_path, change=None, tensors=None):
    """A copy of made's transformers directory with config.json values changed and tensors replaced."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(made.hf_dir, hf)
    config = json.loads((hf / "config.json").read_text()) | (change or {})
    (hf / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        weights = load_file(hf / "model.safetensors")
        save_file(tensors(weights), hf / "model.safetensors")
    return hf


def test_a_config_that_ties_an_untied_head_is_refused(untied, tmp_path):
    with pytest.raises(ModelLoadError, match=r"tensor 'lm_head.weight': tie_word_embeddings is true, but the "
                                             r"checkpoint's output head differs from the embedding"):
        load_model(open_checkpoint(edited_hf(untied, tmp_path, {"tie_word_embeddings": True})))


def test_a_tied_checkpoint_may_carry_a_copy_of_the_embedding_as_its_head(tiny, tmp_path):
    def with_head(weights):
        return weights | {"lm_head.weight": weights["model.embed_tokens.weight"].clone()}

    model = load_model(open_checkpoint(edited_hf(tiny, tmp_path, tensors=with_head)))
    reference = load_model(open_checkpoint(tiny.hf_dir))
    ids = torch.tensor([[1, 2, 3, 400]])
    assert torch.equal(model(ids, model.new_state(1, 8), slots=[0]), reference(ids, reference.new_state(1, 8), slots=[0]))


def test_a_config_without_the_shared_expert_the_weights_hold_is_refused(untied, tmp_path):
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.0.mlp.shared_expert.*': tensor not read by "
                                             r"the model config.json describes"):
        load_model(open_checkpoint(edited_hf(untied, tmp_path, {"shared_expert_intermediate_size": 0})))


def test_qwen35_moe_always_renormalises_as_transformers_does(untied):
    config = json.loads((untied.hf_dir / "config.json").read_text()) | {"norm_topk_prob": False}
    assert QwenConfig.from_hf(config).norm_topk_prob is True


def test_kimi_routed_scaling_is_bounded():
    raw = {"model_type": "kimi_linear", "vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
           "v_head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "routed_scaling_factor": 1e30}
    with pytest.raises(ModelLoadError, match=r"'routed_scaling_factor' must be a finite number in \(0, 1000\], got 1e\+30"):
        KimiConfig.from_hf(raw)
