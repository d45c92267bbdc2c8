"""bfloat16 checkpoints kept in bfloat16: a BF16 GGUF written by llama.cpp's own quantiser and the same weights as a
bf16 Hugging Face directory load with their matrices in bfloat16 (values exactly the file's, none of float16's
range loss), give the same logits as each other, and match llama.cpp on the GGUF, which rounds the activations to
bfloat16 at its BF16 matmuls as our AVX512_BF16 kernels do (ops/csrc/bf16.h)."""

import pytest
import torch

from deltaserve.convert import make_model
from deltaserve.engine.llm import LLM
from deltaserve.models.layers import Embedding, Experts, Linear, dequantize, embed_tokens, linear
from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the C++ kernels did not build here")


# max|diff| / std of the last logits from llama.cpp's on the BF16 file, measured 0.010-0.018 (qwen35) and 0.017-0.040
# (qwen35moe: the tiny random router amplifies, llama.cpp's own bf16 and f32 runs there are up to 0.66 apart)
BF16_PARITY = {"qwen35": 3e-2, "qwen35moe": 6e-2}


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
        # values float16 would have changed (below its normal range): the file's own are kept
        assert any(not torch.equal(p.half().float(), p.float()) for p in matrices.values())
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
        near, far = rel_diff(mine, theirs), rel_diff(mine, exact)
        assert near < BF16_PARITY[ours.model.config.arch] and near < far, (step, near, far)
        ids = ids + [int(theirs.argmax())]


def test_float32_activations_match_llama_cpp_float32_run(engines, monkeypatch):
    """BF16_ROUNDED_ACTIVATIONS = False: the file's exact weights times float32 activations, llama.cpp's F32 file's
    arithmetic (held as its F16 file's test is, tests/models/test_llama_cpp_parity.py), prefill and decode."""
    from deltaserve.models import layers
    from tests.models.test_llama_cpp_parity import PROMPT, llama_last_logits, rel_diff

    monkeypatch.setattr(layers, "BF16_ROUNDED_ACTIVATIONS", False)
    ours, _, _, ref32 = engines
    ids = ours.tokenizer.encode(PROMPT)
    for step in range(4):
        mine = ours.score(ids)[-1] if step == 0 else ours.runner.forward([0], [[ids[-1]]])[0]
        theirs = llama_last_logits(ref32, ids)
        assert rel_diff(mine.double().numpy(), theirs) < 1e-3, step
        ids = ids + [int(theirs.argmax())]


def test_decode_plan_takes_bfloat16_weights(engines):
    from deltaserve.models.qwen import plan

    ours = engines[0]
    model = ours.model
    built = plan._plan(model, range(len(model.layers)))
    assert built is not None  # dense and MoE layers alike


# -- the layers' paths for bfloat16 weights, against float64 products --------------------------------------

def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels multiply it (see tests/ops/test_bf16_kernel.py)."""
    from tests.ops.test_bf16_kernel import activations_read

    return activations_read(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    bound = x.shape[-1] * 2.0 ** -23 * (rounded(x).abs() @ w.double().abs().T) + 1e-6
    assert y.dtype == torch.float32 and torch.all((y.double() - ref).abs() <= bound)


def test_linear_with_bias_on_3d_activations():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, 5, 80, generator=g), torch.randn(33, 80, generator=g).bfloat16(), torch.randn(33)
    close(linear(x, w, b), rounded(x) @ w.double().T + b.double(), x, w)
    assert torch.equal(dequantize(w, torch.float32), w.float())


def test_embedding_rows_and_tied_head_read_bfloat16():
    table = Embedding(1000, 80)
    table.weight = torch.nn.Parameter((torch.randn(1000, 80) * 1e-3).bfloat16(), requires_grad=False)
    ids = torch.tensor([[0, 999, 17]])
    assert torch.equal(embed_tokens(table.weight, ids, torch.float32), table.weight.float()[ids])
    h = torch.randn(3, 80)
    close(linear(h, table.weight), rounded(h) @ table.weight.double().T, h, table.weight)


def test_experts_of_stacked_bfloat16_matrices():
    torch.manual_seed(4)
    experts = Experts(3, 80, 40)
    experts.gate_up = torch.nn.Parameter(torch.randn(3, 80, 80).bfloat16(), requires_grad=False)
    experts.down = torch.nn.Parameter(torch.randn(3, 80, 40).bfloat16(), requires_grad=False)
    x = torch.randn(17, 80)
    ids, weights = torch.randint(0, 3, (17, 2)), torch.rand(17, 2)
    with torch.no_grad():
        got = experts(x, ids, weights)
    ref = torch.zeros(17, 80, dtype=torch.float64)
    for t in range(17):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = rounded(x[t:t + 1]) @ experts.gate_up[e].double().T
            act = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
            ref[t] += weights[t, j].double() * (rounded(act.float()) @ experts.down[e].double().T)[0]
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
