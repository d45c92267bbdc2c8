"""Model definitions: the families (one package each: config and layers with their weight table), the
shared trunk (base.py), layers, per-slot state, and the registry that picks a family for a checkpoint."""

from deltaserve.errors import ModelLoadError

from .base import HybridModel
from .kimi import KimiConfig, KimiModel
from .qwen import QwenConfig, QwenModel

FAMILIES: tuple[type[HybridModel], ...] = (QwenModel, KimiModel)
# GGUF general.architecture / HF model_type -> model class
ARCHITECTURES = {name: f for f in FAMILIES for name in (*f.gguf_archs, *f.hf_model_types)}


def family_of(ckpt) -> type[HybridModel]:
    """The model class that reads an opened checkpoint (deltaserve.loader.open_checkpoint)."""
    arch = ckpt.arch if hasattr(ckpt, "metadata") else ckpt.config.get("model_type")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(ckpt.path, f"unknown architecture {arch!r} (deltaserve runs: "
                                        f"{', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[arch]


def load_model(ckpt, dtype=None, device="cpu", weight_dtype=None, kv_dtype=None) -> HybridModel:
    """The model of an opened checkpoint (deltaserve.loader.open_checkpoint), weights on `device`.

    dtype: the activations' dtype (default float32). weight_dtype: how matmul weights are stored; by default,
    with float32 activations, as the file stores them where that is lossless: Q8_0 (torch.int8, see
    layers.quantize_q8) for a Q8_0 file, float16 for other 16-bit or quantised files (lossless for F16, and
    for other quantisations a rounding far below their own); else `dtype`. kv_dtype: the KV cache's; by
    default float16 beside weights stored in 16 or 8 bits with float32 activations (llama.cpp's default
    cache type: half the memory of float32 keys and values), else `dtype`."""
    import torch

    cls = family_of(ckpt)
    dtype = dtype or torch.float32
    if weight_dtype is None:
        weight_dtype = _stored_dtype(ckpt) if dtype == torch.float32 else dtype
    if kv_dtype is None:
        kv_dtype = torch.float16 if dtype == torch.float32 and weight_dtype != torch.float32 else dtype
    return cls.from_checkpoint(ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype, kv_dtype=kv_dtype)


def _stored_dtype(ckpt):
    """How to keep the matmul weights, judged by the file's embedding (the largest one)."""
    import gguf
    import torch

    Q = gguf.GGMLQuantizationType
    if not (hasattr(ckpt, "metadata") and ckpt.has("token_embd.weight")):
        return torch.float32
    qtype = ckpt.qtype("token_embd.weight")
    return torch.float32 if qtype in (Q.F32, Q.F64) else torch.int8 if qtype == Q.Q8_0 else torch.float16


__all__ = ["ARCHITECTURES", "FAMILIES", "HybridModel", "KimiConfig", "KimiModel", "QwenConfig", "QwenModel",
           "family_of", "load_model"]
