"""A GGUF file's header as editable Python values, for tests that corrupt files the way an attacker would.

`read` parses a file with gguf-py's reader (the independent reference); `write` serialises the header as the
GGUF format spells it and appends the original data section byte for byte. Between the two, metadata values
can change type and value and tensor infos can change type, shape and offset, none of which GGUFWriter allows.
"""

from __future__ import annotations

import struct
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

V = GGUFValueType
SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.BOOL: "<?", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
           V.INT32: "<i", V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


@dataclass
class TensorEntry:
    name: str
    ne: list[int]  # ggml order (the reverse of torch's)
    ttype: int
    offset: int  # from the start of the data section


@dataclass
class Value:
    vtype: int  # GGUFValueType
    value: Any  # a scalar, a str, or for ARRAY a list
    item_type: int | None = None  # for ARRAY


@dataclass
class GGUFImage:
    metadata: dict[str, Value]
    tensors: list[TensorEntry]
    data: bytes  # the data section, from its aligned start to the end of the file

    def copy(self) -> GGUFImage:
        return deepcopy(self)

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)


def read(path: str | Path) -> GGUFImage:
    reader = GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        item = field.types[1] if vtype == V.ARRAY and len(field.types) > 1 else None
        metadata[key] = Value(vtype, field.contents(), item)
    tensors = [TensorEntry(t.name, [int(n) for n in t.shape], int(t.tensor_type), int(t.data_offset - reader.data_offset))
               for t in reader.tensors]
    return GGUFImage(metadata, tensors, Path(path).read_bytes()[reader.data_offset:])


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _encode(vtype: int, value: Any, item_type: int | None = None) -> bytes:
    if vtype in SCALARS:
        return struct.pack(SCALARS[vtype], value)
    if vtype == V.STRING:
        return _string(value)
    if vtype == V.ARRAY:
        return struct.pack("<IQ", item_type, len(value)) + b"".join(_encode(item_type, x) for x in value)
    raise ValueError(f"cannot encode value type {vtype}")


def write(image: GGUFImage, path: str | Path) -> Path:
    """The header of `image`, padded to its general.alignment (32 when that is not a power of two), then its
    data section."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(image.tensors), len(image.metadata)))
    for key, v in image.metadata.items():
        out += _string(key) + struct.pack("<I", v.vtype) + _encode(v.vtype, v.value, v.item_type)
    for t in image.tensors:
        out += _string(t.name) + struct.pack(f"<I{len(t.ne)}Q", len(t.ne), *t.ne) + struct.pack("<IQ", t.ttype, t.offset)
    align = image.metadata.get("general.alignment", Value(V.UINT32, 32)).value
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1) or align > 1 << 20:
        align = 32
    out += bytes(-len(out) % align)
    Path(path).write_bytes(bytes(out) + image.data)
    return Path(path)
