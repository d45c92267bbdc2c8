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


def load_model(ckpt, dtype=None, device="cpu"):
    """The model of an opened checkpoint (deltaserve.loader.open_checkpoint), weights on `device`."""
    import torch

    arch = ckpt.arch if hasattr(ckpt, "metadata") else ckpt.config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(ckpt.path, f"unknown architecture '{arch}' (deltaserve runs: "
                                        f"{', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[arch].from_checkpoint(ckpt, dtype=dtype or torch.float32, device=device)


__all__ = ["ARCHITECTURES", "KimiConfig", "KimiModel", "QwenConfig", "QwenModel", "load_model"]
