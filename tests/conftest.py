import pytest

from deltaserve.convert import make_model


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A random-weight tiny qwen35 GGUF with its own byte-level BPE tokenizer and ChatML template."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen35.gguf"
    make_model("qwen35", "tiny", "f32", path, seed=0)
    return path
