"""Matmul weights kept in the GGML blocks a GGUF file stores them in (TYPES: the K-quants Q2_K .. Q6_K, IQ4_XS,
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, and Q8_0 rows beside them):
never widened at load, read by C++ kernels that widen them in registers (decode) or a block of rows at a time
(prefill, embedding lookups). A Q4_K_M file then takes its own size in memory, not twice it as float16.

The packed form of a weight of logical shape [..., N, K] is a uint8 parameter [..., nbytes] (one byte string
per matrix: its rows one after the other) carrying `.packing`: the GGML type of each run of rows (a fused
projection may mix types: llama.cpp's Q4_K_M keeps some parts in Q6_K), the logical shape, and, where the
file's columns are held in another order (Qwen3.5's tiled value heads), the gather that feeds them x.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from torch import nn

from deltaserve.errors import DeltaserveError
from deltaserve.loader import quants
from deltaserve.loader.memory import weight_empty
from deltaserve.models.weights import IDENTITY, Cat, Leaf, Layout
from deltaserve.ops import fused

TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                   Q.Q6_K, Q.IQ4_XS})  # those the float kernels read (kquants.h)
# A matrix all of Q8_0 is held as int8 + scales instead (layers.quantize_q8), whose integer kernels beat these; Q8_0
# rows are packed where a fused projection mixes them with other types (a MoE Q4_K_M file's attention inputs).
INT8_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})  # integer kernels in every build (int8dot.h)
# Matrices all of int8_types() multiply activations rounded to int8 (per 256 for K-quants and IQ4_XS, llama.cpp's Q8_K;
# per 32 for the types of 32-weight blocks, its Q8_0), as llama.cpp does on these files: its speed, and its rounding.
# False: float32 activations times the exact weights (slower).
INT8_ACTIVATIONS = True
PANEL_ROWS = 16  # rows per panel (ops/csrc/panels.h)
_GEMV_ROWS = 16  # up to this many activation rows the GEMV reads the blocks; above, dequantise + GEMM
_DEQUANT_BYTES = 4 << 20  # the float32 rows a GEMM widens at a time


@dataclass(frozen=True, eq=False)
class Packing:
    """How a packed parameter's bytes hold its matrices: `segments` ((type, rows), ...) of each matrix in row
    order, the logical `shape` [..., N, K], `x_index` (gather x[..., x_index] before the file's rows
    multiply it) or None, and `panels`: K-quant rows held 16 to a panel (ops/csrc/panels.h; see to_panels)."""

    segments: tuple[tuple[Q, int], ...]
    shape: tuple[int, ...]
    x_index: torch.Tensor | None = None
    panels: bool = False
    # int64 [S, 5] for the kernels: type, first row, end row, byte offset, rows per panel (16, or 0: as in the file)
    table: torch.Tensor = field(init=False)

    def __post_init__(self):
        rows, offset, table = 0, 0, []
        for qtype, n in self.segments:
            paneled = self.panels and qtype in panel_types()
            table.append((int(qtype), rows, rows + n, offset, PANEL_ROWS if paneled else 0))
            rows, offset = rows + n, offset + n * row_bytes(qtype, self.shape[-1])
        object.__setattr__(self, "table", torch.tensor(table, dtype=torch.int64).view(-1, 5))

    @functools.cached_property
    def int8(self) -> bool:
        """Whether every segment's type has integer kernels in this build."""
        return all(qtype in int8_types() for qtype, _ in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes of one matrix."""
        return sum(n * row_bytes(t, self.shape[-1]) for t, n in self.segments)

    @functools.cached_property
    def matrix(self) -> Packing:
        """The packing of one of stacked matrices (made once: experts are taken apart every step)."""
        return Packing(self.segments, self.shape[1:], self.x_index, self.panels)


def row_bytes(qtype: Q, K: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return K // block * size


def is_packed(w: torch.Tensor) -> bool:
    return getattr(w, "packing", None) is not None


def parameter(data: torch.Tensor, packing: Packing) -> nn.Parameter:
    """The packed parameter of bytes `data` [..., packing.nbytes]."""
    p = nn.Parameter(data, requires_grad=False)
    p.packing = packing
    return p


@functools.cache
def int8_types() -> frozenset:
    """The types with integer kernels in this machine's build: INT8_TYPES; with AVX2 or AVX-512 VNNI the types of
    32-weight blocks Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and Q8_0 (rows beside others'), which multiply activations
    rounded per 32 (llama.cpp's Q8_0) where the rest take them per 256 (Q8_K)."""
    if not fused.available():
        return INT8_TYPES
    return frozenset(Q(t) for t in fused.extension().int8_types())


@functools.cache
def panel_types() -> frozenset:
    """The types whose rows this build's integer kernels read 16 to a panel (ops/csrc/panels.h): on AVX-512 the
    K-quants and Q4_0, and IQ4_XS where AVX-512 VNNI is built; none elsewhere."""
    if not fused.available():
        return frozenset()
    return frozenset(Q(t) for t in fused.extension().int8_panel_types())


def panels_here() -> bool:
    """Whether this machine's integer kernels read K-quant (and Q4_0) matrices in row panels (AVX-512 builds)."""
    return fused.available() and fused.extension().int8_panels() == PANEL_ROWS


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """Packed parameter w with its K-quant and Q4_0 rows moved into row panels, in place (its bytes and nothing else),
    where this machine's integer kernels read them so (every row of w of a type they take); w unchanged otherwise:
    the float kernels read the file's rows 3.5x faster than panels (a Q8_0 + Q4_K projection, 0.25 vs 0.88 ms)."""
    pk = w.packing
    if pk.panels or not panels_here() or not pk.int8:
        return w
    out = parameter(w.data, Packing(pk.segments, pk.shape, pk.x_index, panels=True))
    for matrix in out.data.view(-1, pk.nbytes):  # one matrix at a time (stacked experts)
        fused.extension().to_panels(matrix, out.packing.table, pk.shape[-1])
    return out


def part(w: torch.Tensor, index: int) -> torch.Tensor:
    """Matrix `index` of stacked packed matrices (an expert), packed the same way."""
    out = w[index]
    out.packing = w.packing.matrix
    return out


def take_rows(w: torch.Tensor, ranges, pad: int = 0) -> nn.Parameter:
    """Rows of packed matrix w (2-D) in its own blocks: each (start, end) of `ranges` in turn, then `pad` rows
    of zero bytes (every type in TYPES reads zero scales as zero weights). A tensor-parallel rank's share of
    the output features."""
    pk = w.packing
    assert not pk.panels, "shares are taken of the file's rows, before to_panels"
    K = pk.shape[-1]
    pieces, segments = [], []
    for start, end in ranges:
        for qtype, first, last, offset, _ in pk.table.tolist():
            a, b = max(start, first), min(end, last)
            if a < b:
                size = row_bytes(Q(qtype), K)
                pieces.append(w[offset + (a - first) * size:offset + (b - first) * size])
                segments.append((Q(qtype), b - a))
    if pad:
        qtype = segments[-1][0] if segments else pk.segments[-1][0]
        pieces.append(torch.zeros(pad * row_bytes(qtype, K), dtype=torch.uint8))
        segments.append((qtype, pad))
    merged = []
    for qtype, n in segments:  # neighbouring runs of one type are one segment
        if merged and merged[-1][0] == qtype:
            merged[-1] = (qtype, merged[-1][1] + n)
        else:
            merged.append((qtype, n))
    packing = Packing(tuple(merged), (sum(n for _, n in merged), K), pk.x_index)
    return parameter(torch.cat(pieces), packing)


def take_columns(w: torch.Tensor, start: int, end: int, name: str = "") -> nn.Parameter:
    """Held columns start:end of packed matrix w (2-D), as whole blocks of the file's: a tensor-parallel rank's
    share of the input features. The file columns they are (in file order where x_index reorders them) must
    fill whole blocks of each type's block size; otherwise a DeltaserveError names the tensor (`name`) and the
    block size: a block's weights share one scale and cannot be parted."""
    pk = w.packing
    assert not pk.panels, "shares are taken of the file's rows, before to_panels"
    N, K = pk.shape
    held = pk.x_index if pk.x_index is not None else torch.arange(K)  # each file column's held column
    keep = (held >= start) & (held < end)
    x_index = held[keep] - start
    pieces = []
    for qtype, first, last, offset, _ in pk.table.tolist():
        block, size = GGML_QUANT_SIZES[Q(qtype)]
        count = keep.view(K // block, block).sum(-1)
        if bool(((count > 0) & (count < block)).any()):
            raise DeltaserveError(f"{name or 'a packed matrix'}: columns {start}:{end} of {K} do not fall on "
                                  f"{Q(qtype).name} block boundaries ({block} values a block share a scale): "
                                  "this --tp does not split it (try another --tp, --pp, or a float or Q8_0 file)")
        rows = w[offset:offset + (last - first) * row_bytes(Q(qtype), K)].view(last - first, K // block, size)
        pieces.append(rows[:, count == block].reshape(-1))
    ordered = torch.equal(x_index, torch.arange(end - start))
    packing = Packing(pk.segments, (N, end - start), None if ordered else x_index)
    return parameter(torch.cat(pieces), packing)


def take_matrices(w: torch.Tensor, start: int, end: int) -> nn.Parameter:
    """Matrices start:end of stacked packed matrices (experts), copied: the whole stack can then be freed."""
    pk = w.packing
    return parameter(w[start:end].clone(), Packing(pk.segments, (end - start, *pk.shape[1:]), pk.x_index, pk.panels))


def rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), K]: rows `ids` of a packed matrix, exactly as the file's values (in the held
    column order)."""
    pk = w.packing
    ids = ids.reshape(-1).to(torch.int64)
    if fused.available():
        out = torch.empty(ids.numel(), pk.shape[-1])
        fused.extension().packed_rows(w.contiguous(), pk.table, pk.shape[-1], ids.contiguous(), out)
    else:
        out = _rows_torch(w, ids)
    return out if pk.x_index is None else out[:, _held_order(pk)]


def _rows_torch(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """rows() through the torch dequantisers (no C++ compiler here, so no panels), a segment at a time."""
    pk, K = w.packing, w.packing.shape[-1]
    assert not pk.panels, "row panels are made only where the C++ kernels run"
    out = torch.empty(ids.numel(), K)
    for qtype, first, end, offset, _ in pk.table.tolist():
        inside = (ids >= first) & (ids < end)
        if inside.any():
            size = row_bytes(Q(qtype), K)
            blocks = w[offset:offset + (end - first) * size].view(end - first, size)[ids[inside] - first]
            out[inside] = quants.dequantize(blocks.reshape(-1), Q(qtype), (int(inside.sum()), K))
    return out


def _held_order(pk: Packing) -> torch.Tensor:
    """The file column each held column comes from (the inverse of x_index)."""
    return torch.argsort(pk.x_index)


def dequantize(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole packed matrix (or stack of matrices) in `dtype`."""
    pk = w.packing
    if len(pk.shape) > 2:
        return torch.stack([dequantize(part(w, i), dtype) for i in range(pk.shape[0])])
    return rows(w, torch.arange(pk.shape[0])).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) in x's dtype for a packed matrix W: matrices of int8_types() through the integer kernels
    (see INT8_ACTIVATIONS); otherwise up to 16 rows of float32 activations through the GEMV kernel (the blocks
    stream from memory once), more through float32 GEMMs on blocks of dequantised rows. (A decode step makes ~100
    of these calls: no-op conversions are skipped, each costs a microsecond.)"""
    pk = w.packing
    N, K = pk.shape
    xr = x.view(-1, K) if x.is_contiguous() else x.reshape(-1, K)
    if pk.x_index is not None:
        xr = xr.index_select(1, pk.x_index)
    cpu = x.device.type == "cpu" and fused.available()
    if cpu and uses_int8(w):
        y = torch.empty(xr.shape[0], N)
        xr = xr if xr.dtype == torch.float32 else xr.float()
        fused.extension().linear_int8(fused.kernel_rows(xr), w, pk.table, y)
    elif cpu and xr.shape[0] <= _GEMV_ROWS and x.dtype == torch.float32:
        y = torch.empty(xr.shape[0], N)
        fused.extension().linear_packed(xr.contiguous(), w, pk.table, y)
    else:
        y = _blocked_gemm(xr, w)
    y = y.view(*x.shape[:-1], N)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def uses_int8(w: torch.Tensor) -> bool:
    """Whether linear() multiplies packed matrix w by activations rounded to int8 (see INT8_ACTIVATIONS)."""
    return INT8_ACTIVATIONS and w.packing.int8


def _blocked_gemm(xr: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xr [M, K] (file column order) @ W^T in float32, W dequantised a block of rows at a time into one reused
    buffer: the temporary stays a few MB (not 1 GB for a 248k-row output head) and hot for its GEMM."""
    pk = w.packing
    N, K = pk.shape
    xr = xr.float()
    y = xr.new_empty(xr.shape[0], N)
    step = max(64, _DEQUANT_BYTES // (4 * K))
    buf = torch.empty(min(step, N), K)
    for r in range(0, N, step):
        n = min(step, N - r)
        ids = torch.arange(r, r + n)
        if fused.available():
            fused.extension().packed_rows(w.contiguous(), pk.table, K, ids, buf[:n])
        else:
            buf[:n] = _rows_torch(w, ids)
        torch.mm(xr, buf[:n].T, out=y[:, r:r + n])
    return y


def embed(w: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a packed embedding table in `dtype`, [..., E]."""
    return rows(w, ids).view(*ids.shape, w.packing.shape[-1]).to(dtype)


# -- loading ---------------------------------------------------------------------------------------


def read(layout: Layout, ckpt) -> nn.Parameter | None:
    """The parameter of `layout` (Either options already chosen) in packed form, its bytes copied straight from
    the file: None unless every tensor it is made of is of a type in TYPES (not all Q8_0) and reaches the
    parameter through row reorders (or, for a single matrix, a column reorder) only."""
    if not hasattr(ckpt, "raw"):
        return None
    pieces = _pieces(layout, ckpt)
    if pieces is None:
        return None
    matrices, x_index = pieces
    segments = _segments(matrices[0])
    if any(_segments(m) != segments for m in matrices) or all(t == Q.Q8_0 for t, _ in segments):
        return None
    stack = (len(matrices),) if len(_first_leaf(layout).shape) == 3 else ()  # experts
    packing = Packing(segments, (*stack, sum(n for _, n in segments), _first_leaf(layout).shape[-1]), x_index)
    data = weight_empty((*stack, packing.nbytes), torch.uint8)
    flat = data.view(len(matrices), packing.nbytes)
    for i, m in enumerate(matrices):
        torch.cat([raw.reshape(-1) for _, raw in m], out=flat[i])
    for name in _leaf_names(layout):
        _drop_pages(ckpt, name)
    return parameter(data, packing)


def _pieces(layout: Layout, ckpt):
    """([matrix: [(type, raw rows [n, row bytes]), ...]], x_index) or None where the layout cannot stay packed."""
    if isinstance(layout, Leaf):
        return _leaf_pieces(layout, ckpt)
    if not isinstance(layout, Cat):
        return None
    parts = [_pieces(p, ckpt) for p in layout.parts]
    if any(p is None or p[1] is not None for p in parts):
        return None
    dims = {len(_first_leaf(p).shape) for p in layout.parts}
    if len(dims) != 1 or layout.dim != dims.pop() - 2:  # along the rows of each matrix
        return None
    counts = {len(p[0]) for p in parts}
    if len(counts) != 1:
        return None
    return [sum((p[0][i] for p in parts), []) for i in range(counts.pop())], None


def _leaf_pieces(leaf: Leaf, ckpt):
    qtype, raw, shape = ckpt.raw(leaf.name)
    if qtype not in TYPES or tuple(shape) != leaf.shape or len(shape) not in (2, 3):
        return None
    size = row_bytes(qtype, shape[-1])
    raw = raw.view(-1, shape[-2], size)
    if leaf.fn is IDENTITY:
        return [[(qtype, m)] for m in raw], None
    if len(shape) != 2 or leaf.fn.axis not in (0, 1):
        return None
    if leaf.fn.axis == 0:  # the file's rows, reordered: each held row is some file row, unchanged
        order = leaf.fn.forward(torch.arange(shape[0], dtype=torch.float64).view(-1, 1)).view(-1).long()
        return [[(qtype, raw[0][order])]], None
    held = leaf.fn.forward(torch.arange(shape[1], dtype=torch.float64).view(1, -1)).view(-1).long()
    return [[(qtype, raw[0])]], torch.argsort(held)  # x in held order -> x in file order


def _segments(matrix) -> tuple[tuple[Q, int], ...]:
    """Runs of rows of one type (neighbouring pieces of the same type merge)."""
    out = []
    for qtype, raw in matrix:
        if out and out[-1][0] == qtype:
            out[-1] = (qtype, out[-1][1] + raw.shape[0])
        else:
            out.append((qtype, raw.shape[0]))
    return tuple(out)


def _first_leaf(layout: Layout) -> Leaf:
    return layout if isinstance(layout, Leaf) else _first_leaf(layout.parts[0])


def _leaf_names(layout: Layout) -> list[str]:
    return [layout.name] if isinstance(layout, Leaf) else [n for p in layout.parts for n in _leaf_names(p)]


def _drop_pages(ckpt, name: str) -> None:
    """The tensor's bytes are copied out: let the file's pages go from this process, as GGUFCheckpoint.load
    does after decoding (else a 5 GB file stays mapped beside its 5 GB copy)."""
    release = getattr(ckpt, "release", None)  # a GGUF file's (a safetensors directory copies nothing out)
    if release is not None:
        release(name)
