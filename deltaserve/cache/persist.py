"""Prefix checkpoints on disk, so a restarted server answers a returning conversation as fast as before;
and one slot's state in a file of its own (llama-server's slot save / restore).

The whole store goes into DIR/checkpoints.safetensors (every block's and mark's KV rows and recurrent
state) with DIR/checkpoints.json beside it: the trie's shape, the model's fingerprint and the data file's
SHA-256. Loading checks all three, and the tensors' shapes and dtypes against what the model's state
holds, before anything reaches a slot: a corrupt, foreign or truncated file is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from deltaserve.models.state import RecurrentCopy

from .prefix import Block, Mark, PrefixStore

log = logging.getLogger("deltaserve.cache")
DATA, INDEX = "checkpoints.safetensors", "checkpoints.json"
FORMAT = 1


def fingerprint(model) -> str:
    """What a checkpoint depends on: the config, the state's shapes and dtypes, and the weights (their
    norms, and the first rows of the embedding, hashed)."""
    h = hashlib.sha256(repr(model.config).encode())
    state = model.new_state(1, 1)
    for t in state.conv + state.ssm + state.k + state.v:
        h.update(repr(None if t is None else (tuple(t.shape[1:]), t.dtype)).encode())
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name == "embed.weight":
            h.update(name.encode())
            h.update(p.detach()[:64].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save(store: PrefixStore, folder: str | Path, model_fingerprint: str) -> Path:
    """Write the store (replacing what was there; the files appear whole or not at all)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    order = {store.root: -1}
    blocks = sorted(store.blocks, key=lambda b: b.end)  # parents before children
    tensors, nodes, marks = {}, [], []
    for i, b in enumerate(blocks):
        order[b] = i
        nodes.append({"parent": order[b.parent], "tokens": list(b.tokens), "state": b.recurrent is not None})
        _put(tensors, f"b{i}", b.k, b.v, b.recurrent)
    for j, m in enumerate(store.marks()):
        marks.append({"block": order[m.block], "tail": list(m.tail)})
        _put(tensors, f"m{j}", m.k, m.v, m.recurrent)
    part = folder / (DATA + ".part")
    save_file(tensors, part)
    digest = hashlib.sha256(part.read_bytes()).hexdigest()
    index = {"format": FORMAT, "fingerprint": model_fingerprint, "sha256": digest, "interval": store.interval,
             "blocks": nodes, "marks": marks}
    (folder / (INDEX + ".part")).write_text(json.dumps(index))
    os.replace(part, folder / DATA)
    os.replace(folder / (INDEX + ".part"), folder / INDEX)
    return folder / DATA


def load(folder: str | Path, model_fingerprint: str, store: PrefixStore, template: RecurrentCopy,
         kv_template: tuple[list, list]) -> int:
    """Fill an empty `store` from `folder`; returns the checkpoints read (0, with a warning, when the files are
    missing, damaged, or made for another model). template / kv_template: a slot's recurrent copy and one
    row of its KV cache, whose shapes and dtypes every tensor read must have."""
    folder = Path(folder)
    if not (folder / INDEX).exists():
        return 0
    try:
        index = json.loads((folder / INDEX).read_text())
        problem = _check(index, folder, model_fingerprint, store.interval)
        if problem is None:
            tensors = load_file(folder / DATA)
            return _fill(store, index, tensors, template, kv_template)
    except (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:  # whatever a damaged file raises
        problem = f"unreadable ({type(e).__name__}: {e})"
    log.warning("ignoring the prefix checkpoints in %s: %s", folder, problem)
    store.clear()
    return 0


def _check(index, folder: Path, model_fingerprint: str, interval: int) -> str | None:
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return "not a deltaserve checkpoint index"
    if index.get("fingerprint") != model_fingerprint:
        return "made for another model"
    if index.get("interval") != interval:
        return f"checkpoints every {index.get('interval')} tokens, not {interval}"
    if hashlib.sha256((folder / DATA).read_bytes()).hexdigest() != index.get("sha256"):
        return "the data file does not match its checksum"
    return None


def _put(tensors: dict, key: str, k, v, recurrent: RecurrentCopy | None) -> None:
    for name, items in (("k", k), ("v", v)) + ((("conv", recurrent.conv), ("ssm", recurrent.ssm)) if recurrent else ()):
        for layer, t in enumerate(items):
            if t is not None:
                # KV rows still viewed in a slot's cache share its storage, which safetensors refuses
                tensors[f"{key}.{name}{layer}"] = t.clone() if t._base is not None else t.contiguous()
    if recurrent is not None:
        tensors[f"{key}.length"] = torch.tensor([recurrent.length])


def _take(tensors: dict, key: str, name: str, like: list, rows: int | None) -> list:
    """Per layer the tensor stored for `key`, checked against `like` (None where the layer has none): of its
    shape, or with `rows` rows of its shape past the first axis (KV rows)."""
    out = []
    for layer, ref in enumerate(like):
        t = tensors.get(f"{key}.{name}{layer}")
        if (ref is None) != (t is None):
            raise ValueError(f"{key}.{name}{layer}: present where the model has no such state, or missing")
        if t is not None:
            want = tuple(ref.shape) if rows is None else (rows, *ref.shape[1:])
            if tuple(t.shape) != want or t.dtype != ref.dtype:
                raise ValueError(f"{key}.{name}{layer}: {list(t.shape)} {t.dtype}, expected {list(want)} {ref.dtype}")
        out.append(t)
    return out


def _recurrent(tensors: dict, key: str, template: RecurrentCopy, end: int) -> RecurrentCopy:
    length = int(tensors[f"{key}.length"][0])
    if length != end:
        raise ValueError(f"{key}: a state after {length} tokens where the trie says {end}")
    return RecurrentCopy(_take(tensors, key, "conv", template.conv, None), _take(tensors, key, "ssm", template.ssm, None),
                         length)


def _fill(store: PrefixStore, index: dict, tensors: dict, template: RecurrentCopy, kv_template) -> int:
    k_like, v_like = kv_template
    made: list[Block] = []
    for i, node in enumerate(index["blocks"]):
        parent = store.root if node["parent"] == -1 else made[node["parent"]]
        tokens = tuple(int(t) for t in node["tokens"])
        if len(tokens) != store.interval or tokens in parent.children:
            raise ValueError(f"block {i}: {len(tokens)} tokens, or a duplicate")
        end = parent.end + store.interval
        block = Block(tokens, end, parent, _take(tensors, f"b{i}", "k", k_like, store.interval),
                      _take(tensors, f"b{i}", "v", v_like, store.interval),
                      _recurrent(tensors, f"b{i}", template, end) if node["state"] else None)
        parent.children[tokens] = block
        store.blocks.add(block)
        made.append(block)
    for j, entry in enumerate(index["marks"]):
        block = store.root if entry["block"] == -1 else made[entry["block"]]
        tail = tuple(int(t) for t in entry["tail"])
        if not 0 < len(tail) < store.interval:
            raise ValueError(f"mark {j}: a tail of {len(tail)} tokens")
        block.marks[tail] = Mark(block, tail, _take(tensors, f"m{j}", "k", k_like, len(tail)),
                                 _take(tensors, f"m{j}", "v", v_like, len(tail)),
                                 _recurrent(tensors, f"m{j}", template, block.end + len(tail)))
    store.nbytes = sum(b.nbytes() for b in store.blocks) + sum(m.nbytes() for m in store.marks())
    store.touch([*store.blocks, *store.marks()])
    store.enforce_budget()
    return store.checkpoints


# ---------------------------------------------------------------------- one slot (llama-server's slot files)
SLOT_FORMAT = "deltaserve-slot/1"


def save_slot(path: str | Path, tokens: list[int], k: list, v: list, recurrent: RecurrentCopy,
              model_fingerprint: str) -> int:
    """Write one slot's state (its tokens, their KV rows, its recurrent state) to `path`, whole or not at
    all; returns the bytes written."""
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.long)}
    _put(tensors, "s", k, v, recurrent)
    meta = {"format": SLOT_FORMAT, "fingerprint": model_fingerprint, "sha256": _digest(tensors)}
    path = Path(path)
    part = path.with_name(path.name + ".part")
    save_file(tensors, part, metadata=meta)
    os.replace(part, path)
    return path.stat().st_size


def load_slot(path: str | Path, model_fingerprint: str, template: RecurrentCopy, kv_template: tuple[list, list],
              max_tokens: int, max_bytes: int) -> tuple[list[int], list, list, RecurrentCopy]:
    """The tokens, KV rows and recurrent state kept in a slot file, checked against this model (fingerprint,
    every shape and dtype, the checksum) and this server (at most `max_tokens` tokens, a file of at most
    `max_bytes`); ValueError naming what is wrong otherwise."""
    path = Path(path)
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path.stat().st_size} bytes, more than a slot of this server holds ({max_bytes})")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") == SLOT_FORMAT and meta.get("fingerprint") == model_fingerprint:
            tensors = load_file(path)
    except SafetensorError as e:
        raise ValueError(f"not a safetensors file ({e})") from None
    if meta.get("format") != SLOT_FORMAT:
        raise ValueError("not a deltaserve slot file")
    if meta.get("fingerprint") != model_fingerprint:
        raise ValueError("made for another model")
    if _digest(tensors) != meta.get("sha256"):
        raise ValueError("the data does not match its checksum")
    ids = tensors.get("tokens")
    if ids is None or ids.dim() != 1 or ids.dtype != torch.long or not 0 < ids.numel() <= max_tokens:
        raise ValueError(f"the token list is missing, empty or longer than this server's context ({max_tokens})")
    tokens = ids.tolist()
    k_like, v_like = kv_template
    k, v = _take(tensors, "s", "k", k_like, len(tokens)), _take(tensors, "s", "v", v_like, len(tokens))
    return tokens, k, v, _recurrent(tensors, "s", template, len(tokens))


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
