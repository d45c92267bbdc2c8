"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: config.py reads and writes their configs, model.py holds the layers
and the weight table."""

from .config import QwenConfig
from .model import GatedDeltaNet, QwenModel

__all__ = ["GatedDeltaNet", "QwenConfig", "QwenModel"]
