"""Float16-stored weights with float32 activations: the same numbers as float32 weights holding the same values."""

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.models.make import make_model


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next", "kimi-linear"])
def test_f16_storage_matches_f32_storage(arch, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", "f16", path, seed=3)
    f16 = LLM(path, max_len=128)  # an f16 file keeps its weights in f16 by default
    f32 = LLM(path, max_len=128, weight_dtype=torch.float32)
    assert f16.model.embed.weight.dtype == torch.float16 and f32.model.embed.weight.dtype == torch.float32
    ids = f16.tokenizer.encode("The weights are stored in half precision, the sums are not.")
    full16, full32 = f16.score(ids), f32.score(ids)  # prefill: the float32 GEMM on widened weights
    torch.testing.assert_close(full16, full32, rtol=1e-5, atol=1e-5)
    a = f16.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)  # decode: the float16 GEMV kernel
    b = f32.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)
    assert a.token_ids == b.token_ids
    step16 = f16.runner.forward([0], [[a.token_ids[-1]]])
    step32 = f32.runner.forward([0], [[b.token_ids[-1]]])
    torch.testing.assert_close(step16, step32, rtol=1e-4, atol=1e-4)
