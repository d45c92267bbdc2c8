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


def load_model(ckpt, dtype=None, device="cpu", weight_dtype=None, kv_dtype=None, part=None) -> HybridModel:
    """The model of an opened checkpoint (deltaserve.loader.open_checkpoint), weights on `device`.

    dtype: the activations' dtype (default float32). weight_dtype: how matmul weights are stored; by default,
    with float32 activations, as the file stores them: for a quantised file (torch.int8, see common._file_form)
    its GGML blocks where our kernels read the type (the K-quants, IQ4_XS, Q4_0/1, Q5_0/1, IQ4_NL, MXFP4, and Q8_0
    rows fused beside them: packed.TYPES), a matrix all of Q8_0 as int8 + scales (layers.quantize_q8), other
    quantisations widened to float16 (a rounding far below their own); float16 for F16 files, bfloat16 for bf16
    ones (GGUF or transformers); else `dtype`. kv_dtype:
    the KV cache's; by default float16 beside weights stored in 16 or 8 bits with float32 activations
    (llama.cpp's default cache type: half the memory of float32 keys and values), else `dtype`. part: see
    common.build."""
    import torch

    cls = family_of(ckpt)
    dtype = dtype or torch.float32
    if weight_dtype is None:
        weight_dtype = _stored_dtype(ckpt) if dtype == torch.float32 else dtype
    if kv_dtype is None:
        kv_dtype = torch.float16 if dtype == torch.float32 and weight_dtype != torch.float32 else dtype
    return cls.from_checkpoint(ckpt, dtype=dtype, device=device, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                              part=part)


def _stored_dtype(ckpt):
    """How to keep the matmul weights: in the file's own form (torch.int8) if any tensor is quantised, else
    judged by the file's embedding (the largest tensor): bfloat16 for a bf16 GGUF file or transformers checkpoint
    (kept exactly, see common.build), float16 for an F16 GGUF file or transformers checkpoint."""
    import gguf
    import torch

    Q = gguf.GGMLQuantizationType
    if not hasattr(ckpt, "metadata"):
        embed = next((n for n in ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
                      if ckpt.has(n)), None)
        kept = {"BF16": torch.bfloat16, "F16": torch.float16}
        return kept.get(ckpt.dtype(embed), torch.float32) if embed is not None else torch.float32
    if not ckpt.has("token_embd.weight"):
        return torch.float32
    if any(ckpt.qtype(n) not in (Q.F32, Q.F64, Q.F16, Q.BF16) for n in ckpt.names()):
        return torch.int8
    embed = ckpt.qtype("token_embd.weight")
    return torch.float32 if embed in (Q.F32, Q.F64) else torch.bfloat16 if embed == Q.BF16 else torch.float16


__all__ = ["ARCHITECTURES", "FAMILIES", "HybridModel", "KimiConfig", "KimiModel", "QwenConfig", "QwenModel",
           "family_of", "load_model"]
