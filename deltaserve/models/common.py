"""What the model families share: building from a checkpoint, fetching tensors, checking a batch."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.models.state import HybridState
from deltaserve.errors import DeltaserveError, ModelLoadError
from deltaserve.loader.gguf_file import progress_bar
from deltaserve.loader.memory import loading_memory, weight_empty
from deltaserve.models import packed
from deltaserve.models.layers import Q8_BLOCK, Experts, Linear, linear, quantize_q8
from deltaserve.models.weights import available, chosen, load_params, names


def build(cls, ckpt, *, dtype: torch.dtype, device, weight_dtype: torch.dtype | None,
          kv_dtype: torch.dtype | None, part=None):
    """An instance of HybridModel subclass `cls` from an opened checkpoint: a GGUF file (has `.metadata`) or
    a transformers directory (has `.config`), read by the family's config class and weight table.
    Parameters whose names end with `cls.keep_fp32` stay float32; the others are stored in `weight_dtype`
    (default `dtype`, the dtype the activations are computed in). weight_dtype=torch.int8 keeps the matmul
    weights in the file's own form (see _file_form): no value of a float or Q8_0 tensor changes.
    weight_dtype=torch.bfloat16 beside float32 activations keeps the matmul weights (linear(), the embedding,
    experts) in bfloat16 where that is exact (a bf16 file's), the other parameters in float32; so does
    weight_dtype=torch.float16 for a transformers checkpoint (float16 where bfloat16 is not exact).
    part: this process's part of a model spread over several (deltaserve.dist): part.cut(model) returns the
    model it holds (still on the meta device: some layers, or every layer with a share of the heads), and
    part.shard(name, t) the share of a parameter read whole; only the parameters left are read."""
    layers, root = layers_in_file(ckpt), "model."
    if getattr(ckpt, "metadata", None) is not None:
        vocab = ckpt.shape("token_embd.weight")[0] if ckpt.has("token_embd.weight") else None
        config = cls.config_class.from_gguf(ckpt.metadata, str(ckpt.path), vocab_size=vocab, max_layers=layers,
                                            tie_word_embeddings=not ckpt.has("output.weight"))
        table, fmt = cls.weight_table(config), "gguf"
    else:
        config = cls.config_class.from_hf(ckpt.config, str(ckpt.path), max_layers=layers)
        root = "model.language_model." if ckpt.has("model.language_model.embed_tokens.weight") else "model."
        table, fmt = cls.weight_table(config, hf_root=root), "hf"
    # the MTP layer loads where the file has all of it; a file without it (or with a part) loads as the trunk
    mtp = [p for p in table if p.name.startswith("mtp.")]
    with_mtp = bool(mtp) and all(available(getattr(p, fmt), ckpt.has) for p in mtp)
    table = table if with_mtp else [p for p in table if not p.name.startswith("mtp.")]
    check_tensors(table, ckpt, fmt, config, hf_root=root)
    with torch.device("meta"):  # before loading: int8 weights cannot require gradients
        model = cls(config, compute_dtype=dtype, cache_dtype=kv_dtype, mtp=with_mtp).requires_grad_(False)
    if part is not None:
        model = part.cut(model)
        held = dict(model.named_parameters())
        table = [p for p in table if p.name in held]
    stored = weight_dtype or dtype
    keep = {name for name, _ in model.named_parameters() if name.endswith(cls.keep_fp32)}
    file_form = stored == torch.int8
    # bfloat16 (or a transformers checkpoint's float16) matmul weights beside float32 activations: the rest (norms,
    # gates, conv) widened to float32, so a tensor the checkpoint keeps in float32 is never rounded
    narrow = dtype == torch.float32 and (stored == torch.bfloat16 or (stored == torch.float16 and fmt == "hf"))
    matmul = set()
    if file_form or narrow:  # only weights that linear() / embed_tokens() read may stay quantised or in bfloat16
        matmul = ({f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, Linear)} | {"embed.weight"}
                  | {f"{m}.{w}" for m, mod in model.named_modules() if isinstance(mod, Experts) for w in ("gate_up", "down")})
        matmul -= keep
    if file_form:
        stored = torch.float16
        matmul = matmul if torch.device(device).type == "cpu" else set()  # their kernels are CPU ones
    params = {}
    total = sum(p.numel() * (4 if n in keep else stored.itemsize) for n, p in model.named_parameters())
    with progress_bar(total, f"loading {Path(ckpt.path).name}") as bar, loading_memory():
        for p in table:  # one tensor at a time: the file's copy is never held whole
            if file_form and p.name not in keep:
                params[p.name] = _file_form(p, ckpt, fmt, p.name in matmul, device, part)
            else:
                (_, t), = load_params([p], ckpt, fmt)
                t = t if part is None else part.shard(p.name, t)
                kind = torch.float32 if p.name in keep else stored
                params[p.name] = _store(t, (_narrowest(t) if p.name in matmul else torch.float32) if narrow else kind,
                                        device)
            bar.update(math.prod(model.get_parameter(p.name).shape) * (4 if p.name in keep else stored.itemsize))
    _assign(model, params, ckpt)
    return model.eval()


def _file_form(p, ckpt, fmt: str, matmul: bool, device, part=None) -> torch.Tensor:
    """Parameter `p` kept as the file stores it, where linear() reads that form (`matmul`): the file's GGML blocks
    (models/packed.py) where the kernels read their types, else Q8_0 (int8 + scales) where the values are
    exactly that; float16 where that is exact, or where the file holds it in a quantisation coarser than Q8_0
    (a rounding far below the quantisation's own; a Q8_0 file's values never change); else bfloat16 where that
    is exact (a BF16 tensor), else float32.
    part: as build's; its share is taken of the packed blocks, or of the values before they are stored."""
    layout = chosen(getattr(p, fmt), ckpt.has) if getattr(p, fmt) is not None else None
    typed = layout is not None and hasattr(ckpt, "qtype")
    source = ", ".join(f"{n} {ckpt.qtype(n).name}" if typed else n for n in names(layout)) if layout else ""
    if matmul and layout is not None:
        w = packed.read(layout, ckpt)
        if w is not None:  # the share of the file's rows, then its K-quant and Q4_0 rows in panels (to_panels)
            return packed.to_panels(w if part is None else part.shard(p.name, w, source=source))
    (_, t), = load_params([p], ckpt, fmt)
    if part is not None:  # a Q8_0 file's matrix stays in its blocks of 32: a column share must fall on them
        q8 = matmul and typed and all(ckpt.qtype(n) == Q.Q8_0 for n in names(layout))
        t = part.shard(p.name, t, block=Q8_BLOCK if q8 else 1, source=source)
    w = quantize_q8(t) if matmul else None
    if w is not None:
        return w
    coarse = typed and all(ckpt.qtype(n) not in _EXACT_TYPES for n in names(layout))
    return _store(t, torch.float16 if coarse or _fits(t, torch.float16) else _narrowest(t), device)


_EXACT_TYPES = {Q.F32, Q.F16, Q.BF16, Q.F64, Q.Q8_0}  # tensors of these types keep their values exactly


def _assign(model, params: dict[str, torch.Tensor], ckpt) -> None:
    """Load params into the meta-device model; packed ones (whose shape is their bytes') are set directly."""
    missing = sorted(set(dict(model.named_parameters())) - set(params))
    if missing:  # a bug in the weight table, not in the file
        raise ModelLoadError(ckpt.path, f"internal weights not produced: {missing[:5]}")
    packed_names = {n for n, w in params.items() if packed.is_packed(w)}
    result = model.load_state_dict({n: w for n, w in params.items() if n not in packed_names}, assign=True,
                                   strict=not packed_names)
    if set(result.missing_keys) != packed_names or result.unexpected_keys:
        raise ModelLoadError(ckpt.path, f"internal weights do not match the model: {result}")
    for name in packed_names:
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, params[name])


_LAYER = re.compile(r"^(?:blk|(?:.+\.)?layers)\.(\d+)\.")  # GGUF blk.N.*, transformers [...]layers.N.*


def layers_in_file(ckpt) -> int | None:
    """How many distinct layer (block) indices the checkpoint's tensor names hold: a bound on any layer count
    its header states, known before anything is built from that count."""
    if not hasattr(ckpt, "names"):
        return None
    return len({m.group(1) for name in ckpt.names() if (m := _LAYER.match(name))})


def check_tensors(table, ckpt, fmt: str, config, hf_root: str = "model.") -> None:
    """Before anything is allocated: every tensor the weight table reads is in the checkpoint with the shape the
    config gives it, and no layer of the checkpoint goes unread. A GGUF file may hold no tensor the table does
    not read (llama.cpp refuses such files too), except in its next-token-prediction blocks."""
    from deltaserve.models.weights import Leaf, chosen

    read = set()
    for p in table:
        layout = getattr(p, fmt)
        if layout is None:
            raise ModelLoadError(ckpt.path, f"parameter {p.name} has no {fmt} layout")
        pending = [chosen(layout, ckpt.has)]
        while pending:
            node = pending.pop()
            if not isinstance(node, Leaf):
                pending += node.parts
                continue
            if not ckpt.has(node.name):
                raise ModelLoadError(ckpt.path, f"missing tensor (expected shape {list(node.shape)})", tensor=node.name)
            found = tuple(ckpt.shape(node.name))
            if not _same_shape(found, node.shape):
                raise ModelLoadError(ckpt.path, f"expected shape {node.shape} (from the config), found {found}",
                                     tensor=node.name)
            read.add(node.name)
    unread = [n for n in ckpt.names() if n not in read]
    if fmt == "gguf":
        _check_unread_gguf(ckpt, unread, config)
        return
    _check_unread_hf(ckpt, unread, config, hf_root)


def _check_unread_hf(ckpt, unread: list[str], config, hf_root: str) -> None:
    """A transformers checkpoint carries tensors the trunk does not read (vision tower, MTP): the ones refused
    are those a config that disagrees with the weights leaves unread. Any tensor of a layer (layers past
    num_hidden_layers, a shared expert the config says is not there, ...) but rotary buffers older checkpoints
    saved, and an output head that tie_word_embeddings ignores although it differs from the embedding (a head
    equal to it is a harmless duplicate some checkpoints carry)."""
    layer = re.compile(re.escape(hf_root) + r"layers\.(\d+)\.")
    late = sorted(i for n in unread if (m := layer.match(n)) and (i := int(m.group(1))) >= config.num_layers)
    if late:
        raise ModelLoadError(ckpt.path, f"the config has {config.num_layers} layers, but the checkpoint holds "
                             f"tensors of layer {late[0]} ({hf_root}layers.{late[0]}.*)")
    stray = [n for n in unread if layer.match(n) and not n.endswith(".inv_freq")]
    if stray:
        raise ModelLoadError(ckpt.path, f"tensor not read by the model config.json describes ({len(stray)} such "
                             "tensors): the config disagrees with the weights", tensor=stray[0])
    if ("lm_head.weight" in unread and hasattr(ckpt, "same_values")
            and not ckpt.same_values("lm_head.weight", f"{hf_root}embed_tokens.weight")):
        raise ModelLoadError(ckpt.path, "tie_word_embeddings is true, but the checkpoint's output head differs "
                             "from the embedding: the config or the weights are wrong", tensor="lm_head.weight")


def _check_unread_gguf(ckpt, unread: list[str], config) -> None:
    """Tensors of a GGUF file the weight table did not read may only sit in the next-token-prediction blocks
    that follow the trunk, and each such block must be one (hold nextn.* tensors): otherwise block_count or
    nextn_predict_layers disagrees with the file, and a model of the wrong depth would load."""
    n, mtp = config.num_layers, getattr(config, "mtp_layers", 0)
    blocks = {}
    for name in unread:
        m = re.match(r"blk\.(\d+)\.", name)
        if m is None or not n <= int(m.group(1)) < n + mtp:
            raise ModelLoadError(ckpt.path, f"tensor not read by a model of {n} layers (block_count, "
                                 f"nextn_predict_layers or the tensor name is wrong)", tensor=name)
        blocks.setdefault(int(m.group(1)), []).append(name)
    for block, names in sorted(blocks.items()):
        if not any(name.startswith(f"blk.{block}.nextn.") for name in names):
            raise ModelLoadError(ckpt.path, f"block {block} is counted as a next-token-prediction block, but holds "
                                 f"no nextn.* tensors: block_count or nextn_predict_layers is wrong")


def _same_shape(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Shapes match, up to size-1 axes ([C, 1, W] conv weights stored as [C, W])."""
    return got == want or [d for d in got if d != 1] == [d for d in want if d != 1]


class Rows:
    """A float32 matrix [R, C] handed over a block of rows at a time: rows of checkpoint tensors, read and
    dequantised as they are asked for, stacked. While the weights are stored in 16 or 8 bits, neither a
    248k-row embedding (1 GB of float32 at hidden size 1024) nor a fused projection (q | k | v | z | b | a)
    ever exists whole in float32. Slicing rows gives float32 tensors."""

    BLOCK = 2048  # rows per block
    dtype = torch.float32

    def __init__(self, parts: list[tuple[Callable[[int, int], torch.Tensor], int, int]], cols: int):
        self.parts = parts  # (read(start, end) -> rows of a source, first row, end row)
        self.shape = (sum(hi - lo for _, lo, hi in parts), cols)

    @classmethod
    def stack(cls, items: Sequence[Rows | torch.Tensor]) -> Rows:
        """Rows or tensors [r, C], one after the other (a tensor is sliced where it lies)."""
        parts = []
        for x in items:
            parts += x.parts if isinstance(x, Rows) else [(lambda s, e, x=x: x[s:e].float(), 0, x.shape[0])]
        return cls(parts, items[0].shape[1])

    def split(self, sizes: Sequence[int]) -> list[Rows]:
        """Consecutive row ranges of these sizes, as Rows (torch.split's meaning)."""
        out, start = [], 0
        for n in sizes:
            out.append(Rows(self._parts(start, start + n), self.shape[1]))
            start += n
        return out

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, end, _ = rows.indices(self.shape[0])
        pieces = [read(lo, hi) for read, lo, hi in self._parts(start, max(start, end))]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else torch.empty(0, self.shape[1])

    def blocks(self):
        for r in range(0, self.shape[0], self.BLOCK):
            yield r, self[r:r + self.BLOCK]

    def stored_dtype(self) -> torch.dtype | None:
        """The float dtype the file stores every row in (all parts _FileRows of one such dtype), else None."""
        kinds = {read.stored_dtype() if isinstance(read, _FileRows) else None for read, _, _ in self.parts}
        return kinds.pop() if len(kinds) == 1 else None

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """The rows written into out [R, C] (any dtype) a block at a time: a file's rows straight (_FileRows.into),
        other sources through float32."""
        at = 0
        for read, lo, hi in self.parts:
            for r in range(lo, hi, self.BLOCK):
                end = min(hi, r + self.BLOCK)
                if isinstance(read, _FileRows):
                    read.into(r, end, out[at:at + end - r])
                else:
                    out[at:at + end - r] = read(r, end)
                at += end - r
        return out

    def _parts(self, start: int, end: int):
        """The sources' row ranges that make up rows start:end."""
        out, at = [], 0
        for read, lo, hi in self.parts:
            a, b = max(start, at), min(end, at + hi - lo)
            if a < b:
                out.append((read, lo + a - at, lo + b - at))
            at += hi - lo
        return out


def dense(t: torch.Tensor | Rows) -> torch.Tensor:
    """t as one float32 tensor (for the weight functions' reorders, which need it whole)."""
    return t[:] if isinstance(t, Rows) else t


class _FileRows:
    """A checkpoint tensor's rows as a Rows source: float32 (called), or written into a tensor of any dtype (into)."""

    def __init__(self, ckpt, name: str):
        self.ckpt, self.name = ckpt, name

    def __call__(self, start: int, end: int) -> torch.Tensor:
        return self.ckpt.load_rows(self.name, start, end)

    def into(self, start: int, end: int, out: torch.Tensor) -> None:
        self.ckpt.rows_into(self.name, start, end, out)

    def stored_dtype(self) -> torch.dtype | None:
        return self.ckpt.float_dtype(self.name)


def fetch_rows(ckpt, name: str, rows: int, cols: int) -> torch.Tensor | Rows:
    """Tensor `name` [rows, cols] to be read a block of rows at a time where the checkpoint allows (GGUF);
    elsewhere as fetch() gives it."""
    if hasattr(ckpt, "load_rows") and ckpt.has(name) and tuple(ckpt.shape(name)) == (rows, cols):
        return Rows([(_FileRows(ckpt, name), 0, rows)], cols)
    return fetch(ckpt, name, rows, cols)


def stack_rows(items: Sequence[Rows | torch.Tensor]) -> torch.Tensor | Rows:
    """torch.cat of 2-D weights along rows, lazily where any of them is Rows."""
    return Rows.stack(items) if any(isinstance(x, Rows) for x in items) else torch.cat(list(items))


def _fits(t: torch.Tensor | Rows, dtype: torch.dtype) -> bool:
    """Whether every value of t survives a round trip through dtype (rows a file stores in dtype: unread)."""
    if isinstance(t, Rows) and t.stored_dtype() == dtype:
        return True
    blocks = t.blocks() if isinstance(t, Rows) else [(0, t)]
    for _, b in blocks:
        # a few MB of rows at a time: the round trip of a whole embedding would hold two copies of it at load
        parts = b.split(max(1, (1 << 20) // max(1, b[0].numel()))) if b.dim() > 1 else [b]
        if not all(torch.equal(p.to(dtype).to(p.dtype), p) for p in parts):
            return False
    return True


def _narrowest(t: torch.Tensor | Rows) -> torch.dtype:
    """The first of bfloat16, float16, float32 that holds every value of t exactly (a bf16 file's matrices are
    bfloat16; a tensor the file keeps in float32 stays so)."""
    return next((d for d in (torch.bfloat16, torch.float16) if _fits(t, d)), torch.float32)


def _store(t: torch.Tensor | Rows, dtype: torch.dtype, device) -> torch.Tensor:
    """t as a new tensor of dtype on device (weights on CPU in huge-page memory, see weight_empty)."""
    cpu = torch.device(device).type == "cpu"
    if not isinstance(t, Rows):
        return weight_empty(t.shape, dtype).copy_(t) if cpu else t.to(device=device, dtype=dtype)
    return t.into(weight_empty(t.shape, dtype) if cpu else torch.empty(t.shape, dtype=dtype, device=device))


def lm_logits(model, h: torch.Tensor) -> torch.Tensor:
    """float32 logits of the final hidden states h, through the output head or the tied embedding."""
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return linear(h, head).float()


def fetch(ckpt, name: str, *shape: int) -> torch.Tensor:
    """Tensor `name` as float32 of exactly `shape`; size-1 axes may differ ([C, 1, W] conv weights)."""
    if not ckpt.has(name):
        raise ModelLoadError(ckpt.path, f"missing tensor (expected shape {list(shape)})", tensor=name)
    got = tuple(ckpt.shape(name))
    if got != shape and _same_shape(got, shape):
        return ckpt.load(name, dtype=torch.float32).reshape(shape)
    return ckpt.load(name, dtype=torch.float32, shape=shape)


def check_batch(model, input_ids, state: HybridState, slots, logits: str):
    """The arguments of a model's cached forward: ids in the vocabulary, one distinct slot per row, room left.
    Returns input_ids on the model's device and slots as an int64 tensor."""
    if logits not in ("last", "all"):
        raise DeltaserveError(f"logits must be 'last' or 'all', got {logits!r}")
    N, T = check_ids(input_ids, model.config.vocab_size).shape
    slots = torch.as_tensor(slots, dtype=torch.long, device=state.lengths.device).reshape(-1)
    if slots.numel() != N or N == 0 or T == 0:
        raise DeltaserveError(f"input_ids {list(input_ids.shape)} needs N, T >= 1 and one slot per row, "
                              f"got {slots.numel()} slots")
    if (int(slots.min()) < 0 or int(slots.max()) >= state.n_slots or slots.unique().numel() != N):
        raise DeltaserveError(f"slots {slots.tolist()} must be distinct and in [0, {state.n_slots})")
    if state.max_len and int(state.lengths[slots].max()) + T > state.max_len:
        raise DeltaserveError(f"slots {slots.tolist()} at lengths {state.lengths[slots].tolist()} cannot take "
                              f"{T} more tokens (max_len {state.max_len})")
    return input_ids.to(model.embed.weight.device), slots


def check_ids(input_ids, vocab_size: int) -> torch.Tensor:
    """input_ids must be an int64 tensor [N, T] with N, T >= 1 and every id in [0, vocab_size)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (f"{input_ids.dtype} {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise DeltaserveError(f"input_ids must be an int64 tensor [N, T], got {got}")
    if input_ids.numel() == 0:
        raise DeltaserveError(f"input_ids {list(input_ids.shape)} needs N, T >= 1")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise DeltaserveError(f"token ids must be in [0, {vocab_size}), got "
                              f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    return input_ids
