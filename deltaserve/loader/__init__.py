"""Checkpoint readers: GGUF files and Hugging Face safetensors directories, behind one interface.

Both give `names()`, `has(name)`, `shape(name)`, `load(name, dtype, shape, device)` and
`progress(names)`; a model builder loads tensor by tensor so only one copy of the weights exists.

The readers (and torch) are imported on first use, so importing this package stays quick.
"""

import os
from importlib import import_module
from pathlib import Path

from deltaserve.errors import ModelLoadError

_LAZY = {"GGUFCheckpoint": "gguf_file", "SafetensorsCheckpoint": "safetensors_dir", "dequantize": "quants",
         "quantize_q8_0": "quants"}

__all__ = ["GGUFCheckpoint", "SafetensorsCheckpoint", "open_checkpoint", "dequantize",
           "quantize_q8_0"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_checkpoint(path: str | os.PathLike) -> "GGUFCheckpoint | SafetensorsCheckpoint":
    """A `.gguf` file or a directory holding config.json; anything else is a ModelLoadError."""
    from deltaserve.loader.gguf_file import GGUFCheckpoint
    from deltaserve.loader.safetensors_dir import SafetensorsCheckpoint

    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(path, "directory has no config.json (expected a Hugging Face "
                                 "checkpoint directory)")
        return SafetensorsCheckpoint(path)
    if path.suffix.lower() == ".gguf":
        return GGUFCheckpoint(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    raise ModelLoadError(path, "not a checkpoint: expected a .gguf file or a directory with "
                         "config.json")
