"""Model definitions: configs, shared layers, the Qwen hybrid family and Kimi Linear."""

from deltaserve.errors import ModelLoadError

from .config import KimiConfig, QwenConfig
from .kimi import KimiModel
from .qwen import QwenModel

# GGUF general.architecture / HF model_type -> model class
ARCHITECTURES = {
    "qwen35": QwenModel, "qwen35moe": QwenModel, "qwen3next": QwenModel,
    "qwen3_5": QwenModel, "qwen3_5_text": QwenModel, "qwen3_5_moe": QwenModel, "qwen3_5_moe_text": QwenModel,
    "qwen3_next": QwenModel,
    "kimi-linear": KimiModel, "kimi_linear": KimiModel,
}


def load_model(ckpt, dtype=None, device="cpu", weight_dtype=None, kv_dtype=None):
    """The model of an opened checkpoint (deltaserve.loader.open_checkpoint), weights on `device`.

    dtype: the activations' dtype (default float32). weight_dtype: how matmul weights are stored; by default,
    with float32 activations, as the file stores them where that is lossless: Q8_0 (torch.int8, see
    layers.quantize_q8) for a Q8_0 file, float16 for other 16-bit or quantised files (lossless for F16, and
    for other quantisations a rounding far below their own); else `dtype`. kv_dtype: the KV cache's; by
    default float16 beside weights stored in 16 or 8 bits with float32 activations (llama.cpp's default
    cache type: half the memory of float32 keys and values), else `dtype`."""
    import torch

    arch = ckpt.arch if hasattr(ckpt, "metadata") else ckpt.config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(ckpt.path, f"unknown architecture '{arch}' (deltaserve runs: "
                                        f"{', '.join(sorted(ARCHITECTURES))})")
    dtype = dtype or torch.float32
    if weight_dtype is None:
        weight_dtype = _stored_dtype(ckpt) if dtype == torch.float32 else dtype
    if kv_dtype is None:
        kv_dtype = torch.float16 if dtype == torch.float32 and weight_dtype != torch.float32 else dtype
    model = ARCHITECTURES[arch].from_checkpoint(ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype)
    model.cache_dtype = kv_dtype
    return model


def _stored_dtype(ckpt):
    """How to keep the matmul weights, judged by the file's embedding (the largest one)."""
    import gguf
    import torch

    Q = gguf.GGMLQuantizationType
    if not (hasattr(ckpt, "metadata") and ckpt.has("token_embd.weight")):
        return torch.float32
    qtype = ckpt.qtype("token_embd.weight")
    return torch.float32 if qtype in (Q.F32, Q.F64) else torch.int8 if qtype == Q.Q8_0 else torch.float16


__all__ = ["ARCHITECTURES", "KimiConfig", "KimiModel", "QwenConfig", "QwenModel", "load_model"]
