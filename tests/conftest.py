import pytest

from deltaserve.ops import fused

from deltaserve.convert import make_model
from deltaserve.engine.llm import load
from deltaserve.models import FAMILIES

ARCHES = [arch for family in FAMILIES for arch in family.gguf_archs]  # every registered family


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A random-weight tiny qwen35 GGUF with its own byte-level BPE tokenizer and ChatML template."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen35.gguf"
    make_model("qwen35", "tiny", "f32", path, seed=0)
    return path


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    """arch -> a random-weight tiny GGUF of that architecture (made once per session)."""
    root = tmp_path_factory.mktemp("cache-models")
    made = {}

    def get(arch: str, seed: int = 5, dtype: str = "f32"):
        key = (arch, seed, dtype)
        if key not in made:
            made[key] = root / f"{arch}-{seed}-{dtype}.gguf"
            make_model(arch, "tiny", dtype, made[key], seed=seed)
        return made[key]

    return get


@pytest.fixture(scope="session")
def loaded(model_path):
    """arch -> (model, tokenizer), loaded once per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load(model_path(arch))
        return cache[arch]

    return get


@pytest.fixture(params=["amx", "avx512"])
def prefill_path(request):
    """The prefill GEMMs (bf16 and integer) on AMX tiles where this CPU grants them, and on the AVX-512 registers
    everywhere; decode paths are the same under both."""
    if not fused.available():
        pytest.skip("the C++ kernels did not build here")
    ext = fused.extension()
    if request.param == "amx" and not ext.set_amx(True):
        pytest.skip("no AMX tiles here (a build without them, or Linux did not grant this process their state)")
    ext.set_amx(request.param == "amx")
    yield request.param
    ext.set_amx(True)
