import pytest

from deltaserve.convert import make_model


@pytest.fixture(scope="session")
def tiny_f16(tmp_path_factory):
    """A random-weight tiny qwen35 model as an F16 GGUF (the converter keeps norms and other 1-D tensors F32)
    and as a Hugging Face directory with the same weights."""
    root = tmp_path_factory.mktemp("untrusted")
    return make_model("qwen35", "tiny", "f16", root / "tiny.gguf", seed=3, hf_dir=root / "hf")
