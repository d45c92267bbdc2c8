"""GGUF files and Hugging Face directories written from a model's parameters through its family's weight
table, read backwards: the same table that loads them (models/weights.py), so no layout is written twice."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType, MODEL_TENSOR

from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.models import FAMILIES, HybridModel
from deltaserve.models.weights import file_tensors
from deltaserve.tokenizer import Tokenizer

DTYPES = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}

# llama.cpp's converter keeps these matrices float32 whatever the file type (ModelBase.prepare_tensors).
_ALWAYS_F32 = {gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") + ".weight"
               for t in (MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_GATE_INP_SHEXP, MODEL_TENSOR.SSM_CONV1D,
                         MODEL_TENSOR.SSM_CONV1D_Q, MODEL_TENSOR.SSM_CONV1D_K, MODEL_TENSOR.SSM_CONV1D_V)}


def family(config) -> type[HybridModel]:
    """The model class whose config `config` is."""
    for cls in FAMILIES:
        if isinstance(config, cls.config_class):
            return cls
    raise DeltaserveError(f"no model family has configs of type {type(config).__name__}")


class TensorDict:
    """Named tensors held in memory, read like an opened checkpoint (has / shape / load)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], path: str = "<memory>"):
        self.tensors, self.path = dict(tensors), path

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def load(self, name: str, dtype: torch.dtype = torch.float32, shape=None) -> torch.Tensor:
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelLoadError(self.path, f"shape {list(t.shape)}, expected {list(shape)}", tensor=name)
        return t.to(dtype)


def gguf_storage(name: str, t: torch.Tensor, want: QType) -> tuple[np.ndarray, QType]:
    """The converter's storage choice for one tensor (ModelBase.prepare_tensors), and the encoded data."""
    data = t.contiguous().numpy()
    qtype = want
    if (data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or re.sub(r"^blk\.\d+\.", "", name) in _ALWAYS_F32):
        qtype = QType.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows that do not split into blocks: the converter falls back to F16
        return gguf.quants.quantize(data, QType.F16), QType.F16


def write_gguf(out_path: str | Path, config, params: Mapping[str, torch.Tensor], tokenizer: Tokenizer | None,
               dtype: str = "f16", name: str | None = None, *, option: int = 0,
               extra: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write a model as the GGUF llama.cpp's converter makes of the equivalent transformers checkpoint.
    params: internal name -> tensor (a model's state_dict, or any mapping; each is read once, in the
    table's order, so a mapping that makes tensors on demand keeps memory to one at a time). The tokenizer
    (None: none) is padded to the config's vocabulary. option=-1 writes the alternative layouts a reader also
    accepts (models/weights.py); extra: tensors the table does not hold, written as they are (an MTP block).
    Parameters without the MTP layer write the trunk alone, whatever the config says of it.
    The file appears complete or not at all."""
    if dtype not in DTYPES:
        raise DeltaserveError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    if tokenizer is not None and config.vocab_size < tokenizer.vocab_size:
        raise DeltaserveError(f"vocab {config.vocab_size} cannot hold the tokenizer's {tokenizer.vocab_size} tokens")
    cls, (want, file_type) = family(config), DTYPES[dtype]
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(None, cls.gguf_archs[_arch_index(cls, config)], use_temp_file=True)
    writer.add_type(gguf.GGUFType.MODEL)
    if name is not None:
        writer.add_name(name)
    config.to_gguf(writer)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer is not None:
        tokenizer.write_gguf(writer, pad_to=config.vocab_size)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    try:
        tensors = file_tensors(_table(cls, config, params), params, "gguf", option)
        for tensor_name, t in itertools.chain(tensors, (extra or {}).items()):
            data, qtype = gguf_storage(tensor_name, t.float(), want)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file(path=part)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, out_path)
    finally:
        writer.close()
        part.unlink(missing_ok=True)
    return out_path


def _table(cls: type[HybridModel], config, params: Mapping[str, torch.Tensor]):
    """The weight table of what params hold: the MTP layer's parameters only where params has them."""
    table = cls.weight_table(config)
    return table if "mtp.fc.weight" in params else [p for p in table if not p.name.startswith("mtp.")]


def _arch_index(cls: type[HybridModel], config) -> int:
    arch = getattr(config, "arch", cls.gguf_archs[0])
    return cls.gguf_archs.index(arch)


def write_hf_dir(out_dir: str | Path, config, params: Mapping[str, torch.Tensor], tokenizer: Tokenizer,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a model as a transformers checkpoint directory: config.json, model.safetensors (tensors in
    `dtype`, bfloat16 as models are released; the MTP layer's as `mtp.*`, where params have it) and the
    tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stream = SafetensorsStream(out_dir / "model.safetensors")
    try:
        for tensor_name, t in file_tensors(_table(family(config), config, params), params, "hf"):
            stream.add(tensor_name, t.to(dtype))
        stream.close()
    except BaseException:
        stream.abort()
        raise
    hf_config = config.to_hf() | {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                                  "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer.save_hf_dir(out_dir)
    return out_dir


class SafetensorsStream:
    """model.safetensors written one tensor at a time: the data goes to a side file until the header
    (which comes first in the file) is known, then both are joined."""

    _DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

    def __init__(self, path: Path):
        self.path, self._part = path, path.with_name(path.name + ".part")
        self._data = open(self._part, "wb+")
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self._header[name] = {"dtype": self._DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + raw.nbytes]}
        raw.tofile(self._data)
        self._offset += raw.nbytes

    def close(self) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        with open(self.path, "wb") as out:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            self._data.seek(0)
            shutil.copyfileobj(self._data, out, 16 << 20)
        self.abort()

    def abort(self) -> None:
        self._data.close()
        self._part.unlink(missing_ok=True)
