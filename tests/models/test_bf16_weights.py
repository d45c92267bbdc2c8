"""bfloat16 checkpoints kept in bfloat16: a BF16 GGUF written by llama.cpp's own quantiser and the same weights as a
bf16 Hugging Face directory load with their matrices in bfloat16 (values exactly the file's, none of float16's
range loss), give the same logits as each other, and match llama.cpp on the GGUF, which rounds the activations to
bfloat16 at its BF16 matmuls as our AVX512_BF16 kernels do (ops/csrc/bf16.h)."""

import pytest
import torch

from deltaserve.convert import make_model
from deltaserve.engine.llm import LLM
from deltaserve.loader import open_checkpoint
from deltaserve.models.layers import Embedding, Experts, Linear, dequantize, embed_tokens, linear
from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not build here")


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def made(request, tmp_path_factory):
    """One random model's weights as a BF16 GGUF (llama.cpp's quantiser), a bf16 HF directory and an F32 GGUF."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python writes the BF16 file (llama.cpp's quantiser)")
    folder = tmp_path_factory.mktemp(request.param)
    bf16 = make_model(request.param, "tiny", "f32", folder / "bf16.gguf", seed=5, quantize="BF16", hf_dir=folder / "hf")
    f32 = make_model(request.param, "tiny", "f32", folder / "f32.gguf", seed=5)
    return bf16.gguf_path, bf16.hf_dir, f32.gguf_path


def matmul_weights(model):
    return {n: p for n, p in model.named_parameters()
            if n == "embed.weight" or n.endswith(("gate_up", "down")) and p.dim() == 3
            or isinstance(model.get_submodule(n.rpartition(".")[0]), Linear) and n.endswith(".weight")}


def test_matrices_stay_bfloat16_with_the_files_values(made):
    gguf, hf, f32 = made
    exact = LLM(f32, max_len=32, weight_dtype=torch.float32).model
    values = dict(exact.named_parameters())
    for path in (gguf, hf):
        model = LLM(path, max_len=32).model
        matrices = matmul_weights(model)
        assert matrices and all(p.dtype == torch.bfloat16 for p in matrices.values()), path
        for name, p in model.named_parameters():
            assert name in matrices or p.dtype == torch.float32, (path, name, p.dtype)
            assert torch.equal(p.float(), values[name].float()), (path, name)


@pytest.fixture(scope="module")
def engines(made):
    pytest.importorskip("llama_cpp")
    from tests.models.test_llama_cpp_parity import llama

    gguf, hf, f32 = made
    return LLM(gguf, max_len=256, prefill_chunk=16), LLM(hf, max_len=256, prefill_chunk=16), llama(gguf), llama(f32)


def test_gguf_and_hf_directory_give_the_same_logits(engines):
    ours_gguf, ours_hf, _, _ = engines
    from tests.models.test_llama_cpp_parity import PROMPT

    ids = ours_gguf.tokenizer.encode(PROMPT)
    a, b = ours_gguf.score(ids), ours_hf.score(ids)
    assert torch.equal(a, b)  # the same weights in the same kernels: not a bit apart


def test_logits_match_llama_cpp_on_the_bf16_file(engines):
    """Prefill (chunks of 16: the GEMM) and 8 decode steps (the GEMV, and the one-call decode plan on qwen35)
    against llama.cpp on the same BF16 file; both are nearer each other than to llama.cpp's float32 run."""
    from tests.models.test_llama_cpp_parity import PROMPT, llama_last_logits, rel_diff

    ours, _, ref, ref32 = engines
    ids = ours.tokenizer.encode(PROMPT)
    assert len(ids) > 16
    for step in range(9):
        mine = ours.score(ids)[-1].double().numpy() if step == 0 else ours.runner.forward([0], [[ids[-1]]])[0].double().numpy()
        theirs, exact = llama_last_logits(ref, ids), llama_last_logits(ref32, ids)
        assert rel_diff(mine, theirs) < BF16_PARITY, (step, rel_diff(mine, theirs))
        assert rel_diff(mine, exact) < BF16_FROM_F32, (step, rel_diff(mine, exact))
        ids = ids + [int(theirs.argmax())]
