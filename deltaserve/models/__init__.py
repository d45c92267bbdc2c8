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


def load_model(ckpt, dtype=None, device="cpu", weight_dtype=None):
    """The model of an opened checkpoint (deltaserve.loader.open_checkpoint), weights on `device`.

    dtype: the activations' dtype (default float32). weight_dtype: how matmul weights are stored; by default
    float16 when the file stores them in 16 bits or quantised (half the memory and bandwidth of float32; lossless
    for F16, and for Q8_0 a rounding 20x below the quantisation's own), else `dtype`."""
    import torch

    arch = ckpt.arch if hasattr(ckpt, "metadata") else ckpt.config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(ckpt.path, f"unknown architecture '{arch}' (deltaserve runs: "
                                        f"{', '.join(sorted(ARCHITECTURES))})")
    dtype = dtype or torch.float32
    if weight_dtype is None:
        weight_dtype = torch.float16 if dtype == torch.float32 and _stores_f16(ckpt) else dtype
    return ARCHITECTURES[arch].from_checkpoint(ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype)


def _stores_f16(ckpt) -> bool:
    """Whether the file keeps its embedding (the largest matmul weight) in fewer than 32 bits."""
    import gguf

    return hasattr(ckpt, "metadata") and ckpt.has("token_embd.weight") and \
        ckpt.qtype("token_embd.weight") not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F64)


__all__ = ["ARCHITECTURES", "KimiConfig", "KimiModel", "QwenConfig", "QwenModel", "load_model"]
