"""Loading quirks: GGUF files laid out the way llama.cpp's converter writes them, MTP blocks in both
formats, and clear errors for missing or mis-shaped tensors.

The GGUF files are written through the family's weight table (deltaserve.convert); that they hold what
llama.cpp's converter writes is tests/convert's business, checked there against llama.cpp's loader rules.
Here the reference is transformers: every layout must give its logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import convert
from deltaserve.errors import ModelLoadError
from deltaserve.loader import open_checkpoint
from deltaserve.models import QwenModel

def write_gguf(tiny, path, *, alt: bool = False) -> None:
    """The transformers checkpoint as a GGUF written through the family's weight table, with one MTP block
    appended after the trunk as llama.cpp appends it (nothing of it may be read). alt: the other layouts
    llama.cpp accepts (legacy ssm_in, fused attention qkv, fused expert gate_up)."""
    model = QwenModel.from_checkpoint(open_checkpoint(tiny.path))
    cfg = dataclasses.replace(model.config, mtp_layers=1)
    n, E = cfg.num_layers, cfg.hidden_size
    extra = {f"blk.{n}.nextn.eh_proj.weight": torch.randn(E, 2 * E),
             f"blk.{n}.attn_norm.weight": torch.full((E,), float("nan"))}
    convert.write_gguf(path, cfg, model.state_dict(), None, "f32", option=-1 if alt else 0, extra=extra)


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
