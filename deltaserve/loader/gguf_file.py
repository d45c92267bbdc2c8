"""A GGUF checkpoint: metadata as Python values (arrays of strings as StringArray, the file's bytes), tensors
dequantised one at a time from the mmap.

The header (a key/value list, then a tensor table) is parsed here rather than by gguf.GGUFReader:
the reader walks every array element by element in Python (15 s for a 250k-token vocabulary on
our dev machine, against 0.3 s here) and trusts the counts it reads, so a cut or corrupt file
fails with bare numpy errors or loops for as long as a garbage length says. Here every read is
checked against the file size first; the tests check the result against GGUFReader.
"""

import mmap
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from tqdm import tqdm

from deltaserve.errors import ModelLoadError
from deltaserve.loader import quants
from deltaserve.strings import StringArray

V = GGUFValueType
_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.BOOL: "<?", V.UINT16: "<H", V.INT16: "<h",
            V.UINT32: "<I", V.INT32: "<i", V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q",
            V.FLOAT64: "<d"}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: real files nest once at most
_MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: the reverse of ggml's ne
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _HeaderParser:
    """Reads the GGUF header from a memory map; any read past the end is a ModelLoadError."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, problem: str, tensor: str | None = None) -> NoReturn:
        raise ModelLoadError(self.path, problem, tensor=tensor)

    def take(self, n: int, what: str) -> int:
        """Claim the next n bytes; returns where they start."""
        if self.pos + n > self.size:
            self.fail(f"file is truncated or corrupt: {what} at byte {self.pos} needs {n} bytes, "
                      f"but the file ends at byte {self.size}")
        self.pos += n
        return self.pos - n

    def scalar(self, vtype: int, what: str):
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        start = self.take(self.scalar(V.UINT64, what), what)
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {start + e.start})")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == V.STRING:
            return self.string(what)
        if vtype != V.ARRAY or depth > _MAX_NESTING:
            self.fail(f"corrupt file: {what} has an unknown value type ({vtype}) or nesting")
        item_type, count = self.scalar(V.UINT32, what), self.scalar(V.UINT64, what)
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type])
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, count, start).tolist() if count else []
        if count * 8 > self.size - self.pos:  # a string or array item takes at least 8 bytes
            self.fail(f"file is truncated or corrupt: {what} claims {count} items, "
                      f"but only {self.size - self.pos} bytes remain")
        if item_type == V.STRING:
            return self.strings(count, what)
        return [self.value(item_type, what, depth + 1) for _ in range(count)]

    def strings(self, count: int, what: str) -> StringArray:
        """An array of `count` strings, each checked as `string` checks one, kept as a StringArray."""
        first, starts = self.pos, np.empty(count, np.uint32 if self.size - self.pos < 1 << 32 else np.int64)
        for i in range(count):
            starts[i] = self.pos + 8 - first  # past its length
            self.string(what)  # checked, then dropped: the array decodes an item again when it is read
        return StringArray(bytes(self.buf[first:self.pos]), starts)

    def tensor_table(self, entries: list, data_start: int, alignment: int) -> dict[str, TensorInfo]:
        """The tensors' types, shapes and byte ranges, laid out as llama.cpp requires (gguf.cpp): in header
        order, each at the offset where the one before it ends, padded to the alignment with zeros, the last
        one ending the file. A changed type or shape changes a byte size, so it shows as an offset that does
        not follow, as data where padding should be zero, or as bytes left over; a shifted or shared offset
        shows the same way. Without this, each of those reads other bytes as weights."""
        tensors: dict[str, TensorInfo] = {}
        expected, before = 0, None  # the next tensor's offset in the data section; the tensor before it
        for name, ne, ttype, offset in entries:
            if name in tensors:
                self.fail("corrupt file: tensor name appears twice", tensor=name)
            shape = tuple(reversed(ne))
            try:
                qtype = GGMLQuantizationType(ttype)
                nbytes = quants.nbytes(qtype, shape)
            except (ValueError, KeyError) as e:
                self.fail(f"corrupt tensor info: {e}", tensor=name)
            if offset % alignment:
                self.fail(f"data offset {offset} is not a multiple of general.alignment ({alignment})", tensor=name)
            if offset != expected:
                self.fail(f"data at offset {offset} of the data section, but {_ends(before, data_start)} at "
                          f"{expected}: a type, shape or offset in the tensor table is corrupt", tensor=name)
            if before is not None:
                self.check_padding(before, data_start + offset)
            start = data_start + offset
            if start + nbytes > self.size:
                self.fail(f"data (bytes {start}..{start + nbytes}) runs past the end of the file "
                          f"({self.size} bytes): the file is truncated", tensor=name)
            before = tensors[name] = TensorInfo(name, qtype, shape, start, nbytes)
            expected = offset + -(-nbytes // alignment) * alignment
        if before is not None:
            if self.size > data_start + expected:
                self.fail(f"{self.size - data_start - expected} bytes follow the data of the last tensor "
                          f"({_ends(before, data_start)} at {expected}): its type or shape is corrupt, or the "
                          "file has trailing bytes")
            self.check_padding(before, self.size)
        return tensors

    def check_padding(self, info: TensorInfo, next_start: int) -> None:
        """The bytes between a tensor's data and the next tensor's (or the end of the file) must be zero, as
        every GGUF writer leaves them: a small tensor whose type was changed to a smaller one (F32 to F16) keeps
        its padded size, and only its old data, now read as padding, gives it away."""
        end = info.offset + info.nbytes
        padding = self.buf[end:next_start]
        if padding.count(0) != len(padding):
            self.fail(f"the {len(padding)} padding bytes after its data (from byte {end}) are not zero: its "
                      f"type ({info.qtype.name}) or shape {info.shape} is corrupt", tensor=info.name)

    def parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        head = bytes(self.buf[:4])
        if head != b"GGUF"[:len(head)]:
            self.fail(f"not a GGUF file (starts with {head!r}, not b'GGUF')")
        if self.size < 24:
            self.fail(f"file is truncated: {self.size} bytes, a GGUF header alone takes 24")
        self.pos = 4
        version = self.scalar(V.UINT32, "version")
        if version & 0xFFFF == 0:
            self.fail("big-endian GGUF files are not supported")
        if version not in (2, 3):
            self.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = self.scalar(V.UINT64, "header"), self.scalar(V.UINT64, "header")
        if n_kv * 13 + n_tensors * 24 > self.size:  # the smallest possible entries
            self.fail(f"file is truncated or corrupt: {n_kv} metadata entries and {n_tensors} "
                      f"tensors cannot fit in {self.size} bytes")

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}")
            vtype = self.scalar(V.UINT32, f"type of metadata '{key}'")
            if key in metadata:
                self.fail(f"corrupt file: metadata key '{key}' appears twice")
            metadata[key] = self.value(vtype, f"metadata '{key}'")
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            self.fail(f"general.alignment must be a power of two, got {alignment!r}")

        entries = []
        for i in range(n_tensors):
            name = self.string(f"name of tensor #{i}")
            what = f"tensor info of '{name}'"
            n_dims = self.scalar(V.UINT32, what)
            if n_dims > _MAX_DIMS:
                self.fail(f"corrupt tensor info: {n_dims} dimensions", tensor=name)
            ne = [self.scalar(V.UINT64, what) for _ in range(n_dims)]
            entries.append((name, ne, self.scalar(V.UINT32, what), self.scalar(V.UINT64, what)))
        data_start = -(-self.pos // alignment) * alignment
        tensors = self.tensor_table(entries, data_start, alignment)
        return metadata, tensors


def _ends(info: TensorInfo | None, data_start: int) -> str:
    """Where the data before a tensor ends, for messages: the tensor before it, its type, shape and range."""
    if info is None:
        return "the data section starts"
    start = info.offset - data_start
    return (f"tensor '{info.name}' before it ({info.qtype.name}, shape {info.shape}, {info.nbytes} bytes from "
            f"offset {start}) ends, padded,")


def progress_bar(total: int, desc: str, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr, quiet when stderr is not a terminal or DELTASERVE_NO_PROGRESS=1."""
    quiet = os.environ.get("DELTASERVE_NO_PROGRESS") == "1" or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=quiet, leave=False)


def progress_over_bytes(names: list[str], sizes: list[int], desc: str) -> Iterator[str]:
    """Yield `names`, advancing a tqdm bar by each one's size once the caller has used it.

    Quiet when stderr is not a terminal or DELTASERVE_NO_PROGRESS=1.
    """
    with progress_bar(sum(sizes), desc) as bar:
        for name, size in zip(names, sizes):
            yield name
            bar.update(size)


class GGUFCheckpoint:
    """One GGUF file, memory-mapped. Tensors are decoded on demand, one at a time."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            problem = "is a directory, not a GGUF file" if self.path.is_dir() else "file not found"
            raise ModelLoadError(self.path, problem)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise ModelLoadError(self.path, "not a GGUF file (the file is empty)")
                # copy-on-write: tensors view the file without copies, and writes stay private
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(self.path, f"cannot read the file: {e.strerror or e}") from None
        self.metadata: dict[str, Any]
        self.metadata, self._tensors = _HeaderParser(self.path, self._buf).parse()
        self._release(0, min((t.offset for t in self._tensors.values()), default=len(self._buf)))  # read, copied
        self.arch: str = self.get("general.architecture")

    def __repr__(self) -> str:
        return f"GGUFCheckpoint('{self.path}', arch={self.arch!r}, tensors={len(self._tensors)})"

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value of `key`; without a default a missing key is a ModelLoadError."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ModelLoadError(self.path, f"required metadata key '{key}' is missing")
        return default

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        """Type, torch-order shape and byte range of tensor `name`."""
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelLoadError(self.path, "tensor not found in the file", tensor=name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch-order shape: the reverse of ggml's ne, so a weight with ne {E, N} is (N, E)."""
        return self.info(name).shape

    def qtype(self, name: str) -> GGMLQuantizationType:
        return self.info(name).qtype

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def raw(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor, tuple[int, ...]]:
        """(type, the stored bytes as a flat uint8 tensor viewing the mmap, torch-order shape)."""
        info = self.info(name)
        data = np.frombuffer(self._buf, np.uint8, info.nbytes, info.offset)
        return info.qtype, torch.from_numpy(data), info.shape

    def load(self, name: str, dtype: torch.dtype = torch.float32, shape=None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor `name` dequantised to a new contiguous `dtype` tensor.

        With `shape`, a tensor of any other shape is a ModelLoadError. With `device`, the raw bytes
        move there first, so the dequantisation runs on that device.
        """
        qtype, raw, found = self.raw(name)
        if shape is not None and tuple(int(s) for s in shape) != found:
            raise ModelLoadError(self.path, f"expected shape {tuple(int(s) for s in shape)}, "
                                 f"found {found}", tensor=name)
        if device is not None:
            raw = raw.to(device)
        try:
            out = quants.dequantize(raw, qtype, found)
        except ValueError as e:
            raise ModelLoadError(self.path, str(e), tensor=name) from None
        self.release(name)
        return out.to(dtype)

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows start:end of a tensor [R, C] dequantised to a new float32 tensor, their file pages then dropped:
        a large embedding read this way never exists whole in float32."""
        qtype, raw, (R, C) = self.raw(name)
        row_bytes = raw.numel() // R  # a row is a whole number of blocks
        start, end = max(0, start), min(R, end)
        try:
            out = quants.dequantize(raw[start * row_bytes:end * row_bytes], qtype, (end - start, C))
        except ValueError as e:
            raise ModelLoadError(self.path, str(e), tensor=name) from None
        info = self.info(name)
        self._release(info.offset + start * row_bytes, (end - start) * row_bytes)
        return out

    def float_dtype(self, name: str) -> torch.dtype | None:
        """float32, float16 or bfloat16 where the file stores tensor `name` so, else None (quantised, float64)."""
        return quants.FLOAT_TYPES.get(self.info(name).qtype)

    def rows_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Rows start:end of a tensor [R, C] written into `out` [end - start, C] (its dtype), their file pages then
        dropped: a float16, bfloat16 or float32 tensor straight from the file's bytes, with no float32 copy on the
        way (an F16 file's weights went through 8 MB float32 blocks of fresh memory, 3 GB for a 0.8B model:
        most of its load time where fresh pages are slow); other types dequantised as load_rows does."""
        qtype, raw, (R, C) = self.raw(name)
        if qtype not in quants.FLOAT_TYPES:
            out.copy_(self.load_rows(name, start, end))
            return
        row_bytes = raw.numel() // R
        out.copy_(raw[start * row_bytes:end * row_bytes].view(quants.FLOAT_TYPES[qtype]).view(end - start, C))
        info = self.info(name)
        self._release(info.offset + start * row_bytes, (end - start) * row_bytes)

    def release(self, name: str) -> None:
        """Tensor `name`'s bytes were copied out (by a caller that read `raw`): drop their pages from this process."""
        self._release(self.info(name).offset, self.info(name).nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """Bytes copied out (a tensor's, the header's): drop their pages from this process (the file stays cached
        by the OS), so loading never holds the file and the weights at once."""
        if hasattr(self._buf, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            first = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
            last = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first:
                self._buf.madvise(mmap.MADV_DONTNEED, first, last - first)

    def progress(self, names: Iterable[str], desc: str = "loading weights") -> Iterator[str]:
        """Yield `names` while a progress bar (on a terminal) counts their stored bytes."""
        names = list(names)
        return progress_over_bytes(names, [self.nbytes(n) for n in names], desc)
