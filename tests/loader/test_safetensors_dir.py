"""SafetensorsCheckpoint on tiny Hugging Face directories written by safetensors.torch.save_file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from deltaserve.errors import ModelLoadError
from deltaserve.loader import SafetensorsCheckpoint, open_checkpoint

CONFIG = {"model_type": "qwen3_5_text", "hidden_size": 5, "layer_types": ["linear_attention"]}


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(3, 5, generator=g),
        "model.norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "model.layers.0.linear_attn.conv1d.weight": torch.randn(2, 3, 4, generator=g).half(),
        "model.layers.0.linear_attn.A_log": torch.randn(3, generator=g, dtype=torch.float64),
    }


def write_dir(path, tensors, shards: int = 1, config=CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(params=[1, 2], ids=["single", "sharded"])
def ckpt_dir(request, tmp_path):
    return write_dir(tmp_path / "hf", make_tensors(), shards=request.param)


def test_reads_names_shapes_and_values(ckpt_dir):
    tensors = make_tensors()
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    assert ckpt.config == CONFIG
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, expected in tensors.items():
        assert ckpt.has(name)
        assert ckpt.shape(name) == tuple(expected.shape)
        got = ckpt.load(name, shape=expected.shape)
        assert got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)
        native = ckpt.load(name, dtype=expected.dtype, device="cpu")
        assert native.dtype == expected.dtype and torch.equal(native, expected)
    assert ckpt.dtype("model.norm.weight") == "BF16"
    assert ckpt.nbytes("model.layers.0.linear_attn.conv1d.weight") == 2 * 3 * 4 * 2


@pytest.mark.parametrize("into", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_written_into_a_tensor(tmp_path, into):
    """rows_into: the stored rows read straight into a tensor of their dtype (the bits as stored), else converted
    as a float32 copy would be."""
    g = torch.Generator().manual_seed(1)
    tensors = {"a.weight": torch.randn(9, 6, generator=g).to(torch.bfloat16),
               "b.weight": torch.randn(5, 4, generator=g).half(), "c.weight": torch.randn(4, 3, generator=g)}
    ckpt = SafetensorsCheckpoint(write_dir(tmp_path / "hf", tensors, shards=2))
    for name, t in tensors.items():
        assert ckpt.float_dtype(name) == t.dtype
        for start, end in [(0, t.shape[0]), (2, t.shape[0] - 1)]:
            out = torch.full((end - start, t.shape[1]), 7.0, dtype=into)
            ckpt.rows_into(name, start, end, out)
            assert torch.equal(out, t[start:end].float().to(into))


def test_missing_tensor_and_shape_mismatch(ckpt_dir):
    ckpt = SafetensorsCheckpoint(ckpt_dir)
    assert not ckpt.has("lm_head.weight")
    with pytest.raises(ModelLoadError, match=r"hf: tensor 'lm_head\.weight': .*not found"):
        ckpt.load("lm_head.weight")
    with pytest.raises(ModelLoadError, match=r"'model\.embed_tokens\.weight'.*expected shape \(5, 3\), found \(3, 5\)"):
        ckpt.load("model.embed_tokens.weight", shape=(5, 3))


def test_progress_and_open_checkpoint(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DELTASERVE_NO_PROGRESS", "1")
    ckpt = open_checkpoint(ckpt_dir)
    assert isinstance(ckpt, SafetensorsCheckpoint)
    names = ckpt.names()[::-1]
    assert list(ckpt.progress(names, desc="test")) == names
    with pytest.raises(ModelLoadError, match="nope"):
        ckpt.progress(["nope"])


def test_missing_or_broken_config(tmp_path):
    d = write_dir(tmp_path / "hf", make_tensors())
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: config\.json not found"):
        SafetensorsCheckpoint(d)
    with pytest.raises(ModelLoadError, match=r"hf: directory has no config\.json"):
        open_checkpoint(d)
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        SafetensorsCheckpoint(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        SafetensorsCheckpoint(d)


def test_missing_weights_and_shards(tmp_path):
    d = write_dir(tmp_path / "single", make_tensors())
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"single: no model\.safetensors and no model\.safetensors\.index\.json"):
        SafetensorsCheckpoint(d)

    d = write_dir(tmp_path / "sharded", make_tensors(), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: shard listed .* is missing"):
        SafetensorsCheckpoint(d)


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    d = write_dir(tmp_path / "sharded", make_tensors(), shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"00001-of-00002\.safetensors: tensor 'lm_head\.weight': listed in"):
        SafetensorsCheckpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelLoadError, match="weight_map"):
        SafetensorsCheckpoint(d)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_file(tmp_path, damage):
    d = write_dir(tmp_path / "hf", make_tensors())
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:-9], "garbage": b"not a safetensors file at all",
                         "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt safetensors file"):
        SafetensorsCheckpoint(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not a checkpoint directory"):
        SafetensorsCheckpoint(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match=r"absent: no such file or directory"):
        open_checkpoint(tmp_path / "absent")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.float8_e4m3fn, torch.bool])
def test_non_float_weights_are_refused(tmp_path, dtype):
    """An FP8 or integer tensor is one half of a quantised layout (its scales are other tensors): read as plain
    values it would be garbage."""
    write_dir(tmp_path, {"model.norm.weight": torch.ones(4).to(dtype)})
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.shape("model.norm.weight") == (4,)
    with pytest.raises(ModelLoadError, match=r"tensor 'model.norm.weight': stored as \w+; weights are read from F64"):
        ckpt.load("model.norm.weight")
