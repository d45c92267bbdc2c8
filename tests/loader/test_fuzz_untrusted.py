"""Fuzzing the loading path with corrupted copies of a tiny random model (make_model): GGUF metadata values,
GGUF tensor infos and config.json values changed in type and value (zero, negative, huge, NaN, wrong type,
missing, a neighbouring value). Every mutated checkpoint must load with the original's logits, or fail with a
DeltaserveError, in bounded time and memory. Changed logits are allowed only for the hyperparameters no tensor
shape pins down (rope base, rotary width, norm epsilon): any value of those is a different valid model.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import load_model
from deltaserve.tokenizer import Tokenizer

from . import gguf_edit
from .gguf_edit import V, Value

IDS = torch.tensor([[1, 5, 9, 200, 3, 17, 400, 2]])
CASE_SECONDS, HANG_SECONDS, RSS_GROWTH_KIB = 5.0, 30, 500 * 1024
# what no tensor shape pins down: other values are other valid models, with other logits
FREE_GGUF = {"qwen35.rope.freq_base", "qwen35.attention.layer_norm_rms_epsilon", "qwen35.rope.dimension_count"}
FREE_HF = {"rms_norm_eps", "rope_parameters", "rope_parameters.rope_theta", "rope_parameters.partial_rotary_factor"}
# about a minute in all by default; DELTASERVE_FUZZ_EXAMPLES=1000 for a longer campaign
EXAMPLES = int(os.environ.get("DELTASERVE_FUZZ_EXAMPLES", "90"))
SETTINGS = settings(deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

INTS = {V.UINT8: (0, 2**8 - 1), V.INT8: (-2**7, 2**7 - 1), V.UINT16: (0, 2**16 - 1), V.INT16: (-2**15, 2**15 - 1),
        V.UINT32: (0, 2**32 - 1), V.INT32: (-2**31, 2**31 - 1), V.UINT64: (0, 2**64 - 1), V.INT64: (-2**63, 2**63 - 1)}
SPECIAL_INTS = [0, 1, -1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 96, 823, 10**8, 2**31 - 1, 2**32 - 1, 2**62, 2**64 - 1]
SPECIAL_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-6, 0.5, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
STRINGS = ["", "4", "qwen35", "qwen35moe", "kimi-linear", "llama", "gpt2", "default", "qwen2", "{{ x }}"]

outcomes: Counter = Counter()
slowest: Counter = Counter()  # seconds of the slowest case of each class


@contextmanager
def hang_guard(seconds: int):
    """A case still running after `seconds` is a hang: SIGALRM turns it into a test failure."""
    def expire(signum, frame):
        raise TimeoutError(f"a mutated checkpoint took over {seconds} s to load")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def logits_of(path: Path) -> torch.Tensor:
    """Tokenizer and model as the engine loads them, then the logits of a short prompt."""
    ckpt = open_checkpoint(path)
    if hasattr(ckpt, "metadata"):
        Tokenizer.from_gguf_metadata(ckpt.metadata, source=str(path))
    else:
        Tokenizer.from_hf_dir(path)
    model = load_model(ckpt)
    return model(IDS, model.new_state(1, 16), slots=[0], logits="all")


def judge(kind: str, path: Path, reference: torch.Tensor, free: bool) -> str:
    """'refused', 'identical' or 'changed' (allowed only when `free`), within the time bound."""
    start = time.monotonic()
    with hang_guard(HANG_SECONDS):
        try:
            logits = logits_of(path)
            outcome = "identical" if torch.equal(logits, reference) else "changed"
        except DeltaserveError:
            outcome = "refused"
    took = time.monotonic() - start
    outcomes[kind, outcome] += 1
    slowest[kind] = max(slowest[kind], took)
    assert took < CASE_SECONDS, f"{kind}: took {took:.1f} s"
    assert outcome != "changed" or (free and bool(torch.isfinite(logits).all())), \
        f"{kind}: loaded with other logits (silent garbage)"
    return outcome


# -- strategies ----------------------------------------------------------------------------------------------


@st.composite
def gguf_values(draw, original: Value | None) -> Value | None:
    """A replacement for a metadata value: near the original, of another type, special, or none (dropped)."""
    kind = draw(st.sampled_from(["near", "int", "float", "bool", "string", "array", "drop"]))
    if kind == "near" and original is not None and original.vtype in INTS:
        vtype = draw(st.sampled_from(list(INTS)))
        lo, hi = INTS[vtype]
        value = original.value + draw(st.sampled_from([-2, -1, 0, 1, 2, original.value]))
        return Value(vtype, min(max(value, lo), hi))
    if kind == "near" and original is not None and original.vtype == V.ARRAY and original.value:
        items = list(original.value)
        change = draw(st.sampled_from(["cut", "grow", "item"]))
        if change == "cut":
            return Value(V.ARRAY, items[:draw(st.integers(0, len(items) - 1))], original.item_type)
        if change == "grow":
            return Value(V.ARRAY, items + items[:draw(st.integers(1, 4))], original.item_type)
        index = draw(st.integers(0, len(items) - 1))
        if original.item_type == V.STRING:
            items[index] = draw(st.sampled_from(STRINGS + [items[0]]))
        elif original.item_type in INTS:
            lo, hi = INTS[original.item_type]
            items[index] = min(max(draw(st.sampled_from([-1, 0, 7, 255, 300, 2**31])), lo), hi)
        return Value(V.ARRAY, items, original.item_type)
    if kind == "int" or kind == "near":
        vtype = draw(st.sampled_from(list(INTS)))
        lo, hi = INTS[vtype]
        return Value(vtype, draw(st.sampled_from([v for v in SPECIAL_INTS if lo <= v <= hi]) | st.integers(lo, hi)))
    if kind == "float":
        return Value(draw(st.sampled_from([V.FLOAT32, V.FLOAT64])), draw(st.sampled_from(SPECIAL_FLOATS)))
    if kind == "bool":
        return Value(V.BOOL, draw(st.booleans()))
    if kind == "string":
        return Value(V.STRING, draw(st.sampled_from(STRINGS) | st.text(max_size=6)))
    if kind == "array":
        item = draw(st.sampled_from([V.UINT32, V.INT32, V.BOOL, V.FLOAT32, V.STRING]))
        values = {V.UINT32: st.sampled_from([0, 1, 4, 6, 2**32 - 1]), V.INT32: st.sampled_from([-1, 0, 2, 6]),
                  V.BOOL: st.booleans(), V.FLOAT32: st.sampled_from([0.0, 1.0, math.nan]),
                  V.STRING: st.sampled_from(STRINGS)}[item]
        return Value(V.ARRAY, draw(st.lists(values, max_size=8)), item)
    return None


EXTRA_KEYS = ["general.alignment", "qwen35.nextn_predict_layers", "qwen35.attention.recurrent_layers",
              "qwen35.vocab_size", "qwen35.expert_count"]


@st.composite
def metadata_mutations(draw, image):
    key = draw(st.sampled_from(list(image.metadata) + EXTRA_KEYS))
    return key, draw(gguf_values(image.metadata.get(key)))


QTYPES = [int(t) for t in GGMLQuantizationType] + [4, 5, 99, 2**32 - 1]
# F16 and BF16 take the same bytes and every 16-bit pattern is a number in both: a swap between them leaves
# nothing to detect (GGUF has no checksums), so the fuzzing leaves that one change out
SAME_SIZE = {int(GGMLQuantizationType.F16): int(GGMLQuantizationType.BF16),
             int(GGMLQuantizationType.BF16): int(GGMLQuantizationType.F16)}


@st.composite
def tensor_mutations(draw, image):
    """(description, edit) where edit changes one GGUFImage in place."""
    index = draw(st.integers(0, len(image.tensors) - 1))
    kind = draw(st.sampled_from(["type", "dim", "dims", "offset", "name", "drop", "swap"]))
    if kind == "type":
        qtype = draw(st.sampled_from(QTYPES))
        assume(SAME_SIZE.get(image.tensors[index].ttype) != qtype)
        return f"type={qtype}", lambda img: setattr(img.tensors[index], "ttype", qtype)
    if kind == "dim":
        axis = draw(st.integers(0, len(image.tensors[index].ne) - 1))
        old = image.tensors[index].ne[axis]
        new = draw(st.sampled_from([0, 1, old - 1, old + 1, 2 * old, old // 2, 2**32, 2**63]))
        return f"ne[{axis}]={new}", lambda img: img.tensors[index].ne.__setitem__(axis, max(new, 0))
    if kind == "dims":
        change = draw(st.sampled_from(["reverse", "append-1", "drop-last", "append-5"]))
        edits = {"reverse": lambda ne: ne.reverse(), "append-1": lambda ne: ne.append(1),
                 "drop-last": lambda ne: ne.pop() if len(ne) > 1 else None, "append-5": lambda ne: ne.extend([1] * 4)}
        return f"dims {change}", lambda img: edits[change](img.tensors[index].ne)
    if kind == "offset":
        delta = draw(st.sampled_from([1, 2, 4, 8, 16, 31, 32, 64, -32, 4096]) | st.integers(-64, 64))
        return f"offset+={delta}", lambda img: setattr(img.tensors[index], "offset",
                                                       max(img.tensors[index].offset + delta, 0))
    if kind == "name":
        other = draw(st.sampled_from([t.name for t in image.tensors] + ["blk.9.attn_norm.weight", "output.weight"]))
        return f"name={other}", lambda img: setattr(img.tensors[index], "name", other)
    if kind == "drop":
        return "drop", lambda img: img.tensors.pop(index)
    other = draw(st.integers(0, len(image.tensors) - 1))
    return f"swap with {other}", lambda img: img.tensors.__setitem__(
        slice(None), _swapped(img.tensors, index, other))


def _swapped(items: list, i: int, j: int) -> list:
    items = list(items)
    items[i], items[j] = items[j], items[i]
    return items


JSON_SPECIAL = [0, -1, 1, 2, 3, 10**8, 2**62, 0.0, -1.0, 0.5, 1e30, math.nan, True, False, None, "", "silu",
                "default", [], [1], ["linear_attention"], {}, {"rope_type": "yarn"}, 1e8, 4.0]


@st.composite
def config_mutations(draw, config: dict):
    """(dotted key, new value or the string 'DROP') for config.json, nested objects (rope_parameters,
    linear_attn_config) included."""
    keys = [k for k, v in config.items() if not isinstance(v, dict)]
    keys += [f"{k}.{sub}" for k, v in config.items() if isinstance(v, dict) for sub in v]
    key = draw(st.sampled_from(keys + [k for k, v in config.items() if isinstance(v, dict)] + ["text_config",
                                                                                               "head_dim"]))
    parent, _, leaf = key.rpartition(".")
    original = config.get(parent, {}).get(leaf) if parent else config.get(key)
    near = []
    if isinstance(original, int) and not isinstance(original, bool):
        near = [original - 1, original + 1, 2 * original, float(original), str(original)]
    elif isinstance(original, list) and original:
        near = [original[:-1], original + original[:1], original[::-1], len(original)]
    return key, draw(st.sampled_from(JSON_SPECIAL + near + ["DROP"]) | st.integers(-2**63, 2**63))


def apply_config(config: dict, key: str, value) -> dict:
    config = json.loads(json.dumps(config))
    parent, _, leaf = key.rpartition(".")
    target = config.setdefault(parent, {}) if parent else config
    if not isinstance(target, dict):
        return config
    if value == "DROP":
        target.pop(leaf, None)
    else:
        target[leaf] = value
    return config


# -- the fuzz tests ------------------------------------------------------------------------------------------


class Work(dict):
    """The originals the cases mutate and compare with (a short repr: hypothesis prints it with a failure)."""

    def __repr__(self) -> str:
        return "Work(original image, logits and config)"


@pytest.fixture(scope="module")
def work(tiny_f16, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return Work(image=gguf_edit.read(tiny_f16.gguf_path), gguf=logits_of(tiny_f16.gguf_path),
                hf=logits_of(tiny_f16.hf_dir), config=json.loads((tiny_f16.hf_dir / "config.json").read_text()),
                hf_dir=tiny_f16.hf_dir, root=root, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


@settings(SETTINGS, max_examples=EXAMPLES)
@given(data=st.data())
def test_mutated_gguf_metadata(work, data):
    key, value = data.draw(metadata_mutations(work["image"]))
    image = work["image"].copy()
    if value is None:
        image.metadata.pop(key, None)
    else:
        image.metadata[key] = value
    path = gguf_edit.write(image, work["root"] / "metadata.gguf")
    judge("gguf metadata", path, work["gguf"], free=key in FREE_GGUF)


@settings(SETTINGS, max_examples=EXAMPLES)
@given(data=st.data())
def test_mutated_gguf_tensor_infos(work, data):
    what, edit = data.draw(tensor_mutations(work["image"]))
    image = work["image"].copy()
    edit(image)
    path = gguf_edit.write(image, work["root"] / "tensors.gguf")
    judge("gguf tensor infos", path, work["gguf"], free=False)


@settings(SETTINGS, max_examples=EXAMPLES)
@given(data=st.data())
def test_mutated_hf_config(work, data):
    key, value = data.draw(config_mutations(work["config"]))
    directory = work["root"] / "hf"
    directory.mkdir(exist_ok=True)
    for source in work["hf_dir"].iterdir():
        if source.name != "config.json" and not (directory / source.name).exists():
            (directory / source.name).symlink_to(source)
    (directory / "config.json").write_text(json.dumps(apply_config(work["config"], key, value)))
    judge("hf config", directory, work["hf"], free=key in FREE_HF)


def test_the_fuzzing_saw_both_outcomes_in_bounded_memory(work):
    """Runs after the three above (file order): each class produced loads and refusals, and memory stayed
    bounded over all cases."""
    for kind in ("gguf metadata", "gguf tensor infos", "hf config"):
        assert outcomes[kind, "refused"] > 10 and outcomes[kind, "identical"] + outcomes[kind, "changed"] > 3, outcomes
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - work["rss"]
    print("\nfuzzing outcomes:", dict(sorted(outcomes.items())), f"peak memory growth {growth // 1024} MiB",
          "slowest case (s):", {k: round(v, 2) for k, v in slowest.items()})
    assert growth < RSS_GROWTH_KIB, f"peak memory grew by {growth // 1024} MiB while fuzzing"
