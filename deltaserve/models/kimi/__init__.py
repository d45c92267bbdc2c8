"""Kimi Linear: config.py reads and writes its config, model.py holds the layers and the weight table."""

from .config import KimiConfig
from .model import KimiDeltaAttention, KimiModel

__all__ = ["KimiConfig", "KimiDeltaAttention", "KimiModel"]
