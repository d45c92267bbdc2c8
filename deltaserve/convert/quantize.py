"""GGUF files quantised by llama.cpp's own quantiser (through llama-cpp-python), as users' downloads are made:
`deltaserve make-model --quantize Q4_K_M` writes an F16 / F32 file and hands it to llama_model_quantize.

llama.cpp picks the type of each tensor itself: a Q4_K_M file keeps some tensors in Q6_K, and rows that do not
split into 256-weight blocks fall back to other types (Q5_0, Q8_0, ...): `tensor_types` says what came out.
"""

from __future__ import annotations

import collections
import ctypes
from pathlib import Path

from deltaserve.errors import DeltaserveError

# file type name -> llama.cpp's llama_ftype (llama.h)
QUANTIZE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15,
                  "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32, "MXFP4_MOE": 38}


def quantize_gguf(src: str | Path, dst: str | Path, qtype: str, threads: int = 0) -> Path:
    """Quantise GGUF `src` (F32 or F16) to `dst` as llama.cpp's `llama-quantize src dst qtype` would."""
    if qtype not in QUANTIZE_TYPES:
        raise DeltaserveError(f"unknown quantisation '{qtype}' (known: {', '.join(QUANTIZE_TYPES)})")
    try:
        import llama_cpp
    except ImportError:
        raise DeltaserveError("quantising needs llama-cpp-python (pip install llama-cpp-python, or "
                              "bash scripts/install-llama-cpp.sh to build it for this CPU)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZE_TYPES[qtype]
    params.nthread = threads
    with _captured_log(llama_cpp) as log:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        Path(dst).unlink(missing_ok=True)
        tail = "".join(log)[-2000:]
        raise DeltaserveError(f"llama.cpp could not quantise {src} to {qtype} (status {status}):\n{tail}")
    return Path(dst)


class _captured_log:
    """llama.cpp's log lines (one per tensor while quantising) collected instead of printed; the previous
    log callback is restored on exit."""

    def __init__(self, llama_cpp):
        self.llama_cpp, self.lines = llama_cpp, []

        def keep(level, text, user_data):
            self.lines.append(text.decode("utf-8", "replace"))
        self.callback = llama_cpp.llama_log_callback(keep)  # held here: C keeps only the pointer

    def __enter__(self) -> list[str]:
        self.old, self.old_data = self.llama_cpp.llama_log_callback(), ctypes.c_void_p()
        self.llama_cpp.llama_log_get(ctypes.byref(self.old), ctypes.byref(self.old_data))
        self.llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))
        return self.lines

    def __exit__(self, *exc) -> None:
        self.llama_cpp.llama_log_set(self.old, self.old_data)


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds, most first."""
    from deltaserve.loader.gguf_file import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    return dict(collections.Counter(ckpt.qtype(n).name for n in ckpt.names()).most_common())
