"""Checks every hybrid family's config makes of itself, and the typed reads its readers make of a checkpoint's
config (no torch here: configs are read by tools that must start fast). Each raises DeltaserveError (reading:
ModelLoadError) naming the field or key and the value."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NoReturn

from deltaserve.errors import DeltaserveError, ModelLoadError

LAYER_TYPES = ("linear_attention", "full_attention")
FFN_TYPES = ("dense", "moe")


def check_hybrid(cfg, what: str, positive: tuple[str, ...]) -> None:
    """The fields named in `positive` are positive integers; layer_types / ffn_types are known, one per layer;
    dense layers have a width; MoE layers have experts, a width and a top-k within them."""
    def bad(problem: str):
        raise DeltaserveError(f"invalid {what} config: {problem}")

    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            bad(f"{name} must be a positive integer, got {value!r}")
    if not cfg.layer_types:
        bad("the model has no layers")
    if unknown := set(cfg.layer_types) - set(LAYER_TYPES):
        bad(f"unknown layer types {sorted(map(str, unknown))}; expected {LAYER_TYPES}")
    if len(cfg.ffn_types) != len(cfg.layer_types):
        bad(f"{len(cfg.ffn_types)} ffn types for {len(cfg.layer_types)} layers")
    if unknown := set(cfg.ffn_types) - set(FFN_TYPES):
        bad(f"unknown ffn types {sorted(map(str, unknown))}; expected {FFN_TYPES}")
    if cfg.conv_kernel < 2:
        bad(f"conv_kernel ({cfg.conv_kernel}) must be at least 2")
    if "dense" in cfg.ffn_types and cfg.intermediate_size <= 0:
        bad(f"dense layers need intermediate_size > 0, got {cfg.intermediate_size}")
    if "moe" in cfg.ffn_types:
        if cfg.num_experts <= 0 or cfg.moe_intermediate_size <= 0:
            bad(f"MoE layers need num_experts ({cfg.num_experts}) and moe_intermediate_size "
                f"({cfg.moe_intermediate_size}) > 0")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            bad(f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in [1, num_experts={cfg.num_experts}]")


# Bounds on what a header may ask for before any list is built from it. llama.cpp stops at 512 layers and
# 512 experts (LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS); twice that leaves room for growth and still refuses a
# block_count of 1e8 in microseconds instead of building 1e8-entry lists for minutes.
MAX_LAYERS = 1024
MAX_EXPERTS = 1024
MAX_SIZE = (1 << 31) - 1  # any width, head count or vocabulary: products of two stay within torch's int64 shapes
REQUIRED = object()  # a read's default: the key must be there


class ConfigReader:
    """Typed reads of one checkpoint config (GGUF metadata or a config.json object), keys under `prefix`. A value
    of the wrong type or out of range is a ModelLoadError naming the file, the key and the value, rather than a
    TypeError or a ZeroDivisionError further on."""

    def __init__(self, values: Mapping[str, Any], source: str, prefix: str = "", shown: str | None = None):
        """shown: how messages name the keys' place (a nested object's "text_config."), by default `prefix`."""
        if not isinstance(values, Mapping):
            raise ModelLoadError(source, f"the config must be a mapping of keys to values, got {_show(values)}")
        self.values, self.source, self.prefix = values, source, prefix
        self.shown = prefix if shown is None else shown

    def under(self, prefix: str) -> ConfigReader:
        """The keys that start with `prefix` (GGUF's "qwen35.")."""
        return ConfigReader(self.values, self.source, prefix)

    def nested(self, key: str) -> ConfigReader:
        """The object at `key` ({} when absent), its keys named `key.name` in messages."""
        return ConfigReader(self.mapping(key), self.source, shown=f"{self.shown}{key}.")

    def fail(self, key: str, problem: str) -> NoReturn:
        raise ModelLoadError(self.source, f"'{self.shown}{key}' {problem}")

    def has(self, key: str) -> bool:
        return self.values.get(self.prefix + key) is not None

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        value = self.values.get(self.prefix + key)
        if value is None:
            if default is REQUIRED:
                self.fail(key, "is missing")
            return default
        return value

    def int(self, key: str, default: Any = REQUIRED, *, low: int = 0, high: int = MAX_SIZE) -> int:
        """An integer in [low, high] (JSON's 4.0 and GGUF's float32 4.0 are not integers, nor is true)."""
        value = self.raw(key, default)
        if not _is_int(value):
            self.fail(key, f"must be an integer, got {_show(value)}")
        if not low <= value <= high:
            self.fail(key, f"must be in [{low}, {high}], got {value}")
        return value

    def float(self, key: str, default: Any = REQUIRED, *, low: float = -math.inf, high: float = math.inf,
              open_low: bool = False) -> float:
        """A finite number in [low, high] ((low, high] with open_low)."""
        value = self.raw(key, default)
        if not _is_int(value) and not isinstance(value, float):
            self.fail(key, f"must be a number, got {_show(value)}")
        value = float(value)
        if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
            interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
            self.fail(key, f"must be a finite number in {interval}, got {value!r}")
        return value

    def flag(self, key: str, default: Any = REQUIRED) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool) and value not in (0, 1):
            self.fail(key, f"must be true or false, got {_show(value)}")
        return bool(value)

    def text(self, key: str, default: Any = REQUIRED) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_show(value)}")
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        """A nested object ({} when absent)."""
        value = self.raw(key, {})
        if not isinstance(value, Mapping):
            self.fail(key, f"must be an object, got {_show(value)}")
        return value

    def items(self, key: str, kind: type, default: Any = REQUIRED, *, length: tuple[int, int] | None = None) -> list:
        """A list of `kind` values (bool accepts 0 / 1, int refuses bools) with a length within `length`."""
        value = self.raw(key, default)
        if not isinstance(value, (list, tuple)):
            self.fail(key, f"must be a list, got {_show(value)}")
        if length is not None and not length[0] <= len(value) <= length[1]:
            want = length[0] if length[0] == length[1] else f"{length[0]} to {length[1]}"
            self.fail(key, f"must have {want} entries, got {len(value)}")
        for i, item in enumerate(value):
            ok = (_is_int(item) if kind is int else isinstance(item, bool) or item in (0, 1) if kind is bool
                  else isinstance(item, kind))
            if not ok:
                self.fail(key, f"must list {kind.__name__} values, but entry {i} is {_show(item)}")
        return [kind(item) for item in value]

    def per_layer(self, key: str, default: Any = REQUIRED, *, n_layers: int, blocks: int,
                  layers: list[int] | None = None, low: int = 0, high: int = MAX_SIZE) -> int:
        """A value llama.cpp allows per layer: one integer, or an array with one per block (`blocks`, MTP blocks
        included, at least the `n_layers` trunk layers) whose entries at `layers` (all trunk layers when None
        or empty) must agree. Either way an integer in [low, high]."""
        value = self.raw(key, default)
        if not isinstance(value, (list, tuple)):
            return self.int(key, default, low=low, high=high)
        entries = self.items(key, int, length=(n_layers, blocks))
        used = {entries[i] for i in (layers or range(n_layers))}
        if len(used) != 1:
            self.fail(key, f"differs between layers: {_show(entries)}")
        value = used.pop()
        if not low <= value <= high:
            self.fail(key, f"must be in [{low}, {high}], got {value}")
        return value


def check_layers(reader: ConfigReader, key: str, n_layers: int, in_file: int | None) -> None:
    """A layer count is bounded by the layers whose tensors the checkpoint holds, before a list is built."""
    if in_file is not None and n_layers > in_file:
        reader.fail(key, f"asks for {n_layers} layers, but the checkpoint holds tensors for {in_file}")


def reads_config(default_source: str):
    """The last line of defence of a config reader (from_hf / from_gguf): a malformed value that slipped past the
    typed reads surfaces as one ModelLoadError naming the file and the exception, and the constructor's checks
    (DeltaserveError) are reported against the file."""
    def decorate(read):
        @functools.wraps(read)
        def guarded(cls, values, *args, **kwargs):
            source = kwargs.get("source", args[0] if args else default_source)
            try:
                return read(cls, values, *args, **kwargs)
            except ModelLoadError:
                raise
            except DeltaserveError as e:
                raise ModelLoadError(source, str(e)) from None
            except (TypeError, ValueError, IndexError, KeyError, AttributeError, ZeroDivisionError,
                    OverflowError) as e:
                raise ModelLoadError(source, f"malformed config ({type(e).__name__}: {e})") from None
        return guarded
    return decorate


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A value and its type for a message, cut short (a header value may be a 250k-entry list)."""
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"
