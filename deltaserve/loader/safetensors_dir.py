"""A Hugging Face checkpoint directory: config.json plus one or several safetensors files."""

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deltaserve.errors import ModelLoadError
from deltaserve.loader.gguf_file import progress_over_bytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
               "I16": 2, "U16": 2}  # everything else (8-bit ints and floats, bool) is 1 byte
# Weights are read only from these: an integer or FP8 tensor is a quantised layout whose scales live in other
# tensors, and converting its raw values to float would load garbage.
WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _data_offsets(path: Path) -> tuple[int, dict[str, int]]:
    """Where a safetensors file's data begins, and each tensor's first byte from there (safetensors checked the
    header when the file was opened: 8 bytes of length, then JSON of each tensor's data_offsets)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return 8 + size, {n: int(v["data_offsets"][0]) for n, v in header.items() if n != "__metadata__"}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ModelLoadError(path, f"{what} not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"{what} must hold a JSON object, got {type(value).__name__}")
    return value


class SafetensorsCheckpoint:
    """A directory with config.json and model.safetensors, or an index and its shards.

    Headers are read up front (names, shapes); tensor data is read lazily, one tensor per load().
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(self.path, "not a checkpoint directory")
        self.config: dict[str, Any] = _read_json(self.path / "config.json", "config.json")
        weight_map = self._weight_map()
        self._files = {shard: self._open(shard) for shard in sorted(set(weight_map.values()))}
        self._where: dict[str, str] = {}
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
        stored = {shard: set(f.keys()) for shard, f in self._files.items()}
        for name, shard in weight_map.items():
            f = self._files[shard]
            if name not in stored[shard]:
                raise ModelLoadError(self.path / shard, f"listed in {INDEX_FILE} but not in the "
                                     "shard", tensor=name)
            info = f.get_slice(name)
            self._where[name] = shard
            self._info[name] = (tuple(int(n) for n in info.get_shape()), info.get_dtype())
        self._data_start, self._offsets = {}, {}  # where each shard's data begins; each tensor's offset in it
        for shard in self._files:
            self._data_start[shard], offsets = _data_offsets(self.path / shard)
            self._offsets.update({n: offsets[n] for n, s in self._where.items() if s == shard})

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> file name inside the directory."""
        if (self.path / INDEX_FILE).is_file():
            index = _read_json(self.path / INDEX_FILE, INDEX_FILE)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise ModelLoadError(self.path / INDEX_FILE, "has no 'weight_map' of tensor -> file")
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise ModelLoadError(self.path / shard, f"shard listed in {INDEX_FILE} is missing")
            return weight_map
        if not (self.path / SINGLE_FILE).is_file():
            raise ModelLoadError(self.path, f"no {SINGLE_FILE} and no {INDEX_FILE}")
        with self._open(SINGLE_FILE) as f:
            return {name: SINGLE_FILE for name in f.keys()}

    def _open(self, shard: str):
        try:
            return safe_open(str(self.path / shard), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(self.path / shard, f"corrupt safetensors file: {e}") from None

    def __repr__(self) -> str:
        return (f"SafetensorsCheckpoint('{self.path}', model_type="
                f"{self.config.get('model_type')!r}, tensors={len(self._info)})")

    def names(self) -> list[str]:
        return list(self._info)

    def has(self, name: str) -> bool:
        return name in self._info

    def _lookup(self, name: str) -> tuple[tuple[int, ...], str]:
        try:
            return self._info[name]
        except KeyError:
            raise ModelLoadError(self.path, "tensor not found in the checkpoint",
                                 tensor=name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._lookup(name)[0]

    def dtype(self, name: str) -> str:
        """The stored safetensors dtype, e.g. 'BF16'."""
        return self._lookup(name)[1]

    def nbytes(self, name: str) -> int:
        shape, dtype = self._lookup(name)
        return math.prod(shape) * _ITEM_BYTES.get(dtype, 1)

    def load(self, name: str, dtype: torch.dtype = torch.float32, shape=None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor `name` as a contiguous `dtype` tensor; with `shape`, any other shape is an error."""
        found, stored = self._lookup(name)
        if shape is not None and tuple(int(s) for s in shape) != found:
            raise ModelLoadError(self.path, f"expected shape {tuple(int(s) for s in shape)}, "
                                 f"found {found}", tensor=name)
        if stored not in WEIGHT_DTYPES:
            raise ModelLoadError(self.path, f"stored as {stored}; weights are read from {', '.join(WEIGHT_DTYPES)} "
                                 "only (quantised checkpoints are not supported)", tensor=name)
        return self._read(name, 0, found[0] if found else 1).reshape(found).to(device=device, dtype=dtype)

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows start:end of a tensor [R, C] as a new float32 tensor: a large embedding read this way never exists
        whole, in the file's dtype or in float32."""
        (_, C), stored = self._lookup(name)
        if stored not in WEIGHT_DTYPES:
            raise ModelLoadError(self.path, f"stored as {stored}; weights are read from {', '.join(WEIGHT_DTYPES)} "
                                 "only", tensor=name)
        return self._read(name, start, end).view(-1, C).float()

    def float_dtype(self, name: str) -> torch.dtype | None:
        """float32, float16 or bfloat16 where the file stores tensor `name` so, else None (float64)."""
        stored = self.dtype(name)
        return _TORCH_DTYPES[stored] if stored in ("F32", "F16", "BF16") else None

    def rows_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Rows start:end of a tensor [R, C] written into `out` [end - start, C]: read straight into it where it
        is contiguous in the stored dtype (no float32 copy on the way), else as load_rows gives them."""
        if out.is_contiguous() and _TORCH_DTYPES.get(self.dtype(name)) == out.dtype:
            self._read(name, start, end, out.view(-1).view(torch.uint8))
        else:
            out.copy_(self.load_rows(name, start, end))

    def _read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start:end (along the first axis) of tensor `name`, flat in its stored dtype (into the uint8 `out`
        where given), read with plain file reads: the file is never mapped into this process, so its pages never
        count in its memory (a mapped checkpoint's would, on top of the weights made from it)."""
        shard, (shape, stored) = self._where[name], self._info[name]
        start, end = max(0, start), min(shape[0] if shape else 1, end)
        row = math.prod(shape[1:]) * _ITEM_BYTES[stored]
        begin = self._data_start[shard] + self._offsets[name] + start * row
        if out is None:
            out = torch.empty(max(0, end - start) * row, dtype=torch.uint8)
        elif out.numel() != max(0, end - start) * row:
            raise ValueError(f"{name}: rows {start}:{end} are {max(0, end - start) * row} bytes, not {out.numel()}")
        with open(self.path / shard, "rb") as f:
            f.seek(begin)
            if f.readinto(out.numpy()) != out.numel():
                raise ModelLoadError(self.path / shard, "the file ends inside the tensor", tensor=name)
        return out.view(_TORCH_DTYPES[stored])

    def same_values(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors a and b hold the same shape and values, compared a block of rows at a time (an
        embedding of 248k rows is never read whole)."""
        if self.shape(a) != self.shape(b):
            return False
        if not self.shape(a):
            return torch.equal(self.load(a), self.load(b))
        return all(torch.equal(self._read(a, r, r + rows).float(), self._read(b, r, r + rows).float())
                   for r in range(0, self.shape(a)[0], rows))

    def progress(self, names: Iterable[str], desc: str = "loading weights") -> Iterator[str]:
        """Yield `names` while a progress bar (on a terminal) counts their stored bytes."""
        names = list(names)
        return progress_over_bytes(names, [self.nbytes(n) for n in names], desc)
