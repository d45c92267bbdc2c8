"""The KV cache's dtype: float16 by default beside 16- and 8-bit weights (llama.cpp's default cache type),
the compute dtype otherwise; a float16 cache stays within float16 rounding of the float32 one."""

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.convert import make_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv")
    paths = {}
    for arch in ("qwen35", "kimi-linear"):
        for dt in ("f32", "f16", "q8_0"):
            paths[arch, dt] = folder / f"{arch}-{dt}.gguf"
            make_model(arch, "tiny", dt, paths[arch, dt], seed=11)
    return paths


def kv_dtypes(llm):
    state = llm.runner.cache.state
    return {t.dtype for t in state.k + state.v if t is not None}


@pytest.mark.parametrize("arch", ["qwen35", "kimi-linear"])
@pytest.mark.parametrize("file_dtype, kv", [("f32", torch.float32), ("f16", torch.float16), ("q8_0", torch.float16)],
                         ids=["f32_file", "f16_file", "q8_0_file"])
def test_default_cache_dtype(files, arch, file_dtype, kv):
    assert kv_dtypes(LLM(files[arch, file_dtype], max_len=64)) == {kv}
    assert kv_dtypes(LLM(files[arch, file_dtype], max_len=64, kv_dtype=torch.float32)) == {torch.float32}
    assert kv_dtypes(LLM(files[arch, file_dtype], max_len=64, weight_dtype=torch.float32)) == {torch.float32}


@pytest.mark.parametrize("arch", ["qwen35", "kimi-linear"])
def test_float16_cache_stays_close_to_float32(files, arch):
    half = LLM(files[arch, "f16"], max_len=256)
    full = LLM(files[arch, "f16"], max_len=256, kv_dtype=torch.float32)
    ids = half.tokenizer.encode("Keys and values kept in half precision, " * 4)
    a, b = half.score(ids), full.score(ids)  # prefill: attention over the cache
    # float16 keeps 11 significant bits: each key and value within 2^-11 relative of float32
    assert (a - b).abs().max() / b.std() < 2e-3
    step_a = half.runner.forward([0], [[ids[-1]]])  # decode: the C++ attention step on a float16 cache
    step_b = full.runner.forward([0], [[ids[-1]]])
    assert (step_a - step_b).abs().max() / step_b.std() < 2e-3
    assert (a - b).abs().max() > 0  # the caches did differ
