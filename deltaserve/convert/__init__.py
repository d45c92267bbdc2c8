"""Writing checkpoints: GGUF files and Hugging Face directories from a model's parameters, each through
its family's weight table read backwards (models/weights.py), and random-weight models at real shapes
for tests and benchmarks (`deltaserve make-model`).

- files.py:   write_gguf, write_hf_dir, a streaming safetensors writer, TensorDict (tensors as a checkpoint)
- presets.py: the preset shapes of each architecture, seeded random weights, make_model
- quantize.py: llama.cpp's quantiser on a written file (make_model(..., quantize="Q4_K_M"))
"""

from .files import TensorDict, write_gguf, write_hf_dir
from .presets import DTYPES, PRESETS, VOCABULARIES, MadeModel, make_model, preset_config, qwen35_tokenizer, train_tokenizer
from .quantize import QUANTIZE_TYPES, quantize_gguf, tensor_types

__all__ = ["DTYPES", "PRESETS", "QUANTIZE_TYPES", "VOCABULARIES", "MadeModel", "TensorDict", "make_model",
           "preset_config", "quantize_gguf", "qwen35_tokenizer", "tensor_types", "train_tokenizer", "write_gguf",
           "write_hf_dir"]
