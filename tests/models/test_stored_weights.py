"""Weights stored as the file holds them (float16, or Q8_0 as int8 + scales) with float32 activations: the same
numbers as float32 weights holding the same values, in prefill (widened GEMM) and decode (the C++ GEMVs)."""

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.models.common import Rows
from deltaserve.loader import open_checkpoint
from deltaserve.models import layers
from deltaserve.models.layers import Linear, dequantize
from deltaserve.convert import make_model, write_hf_dir


@pytest.mark.parametrize("file_dtype, stored, text", [
    ("f16", torch.float16, "The weights are stored in half precision, the sums are not."),
    ("q8_0", torch.int8, "The weights are stored in eight bits, the sums are not."),
], ids=["f16", "q8_0"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next", "kimi-linear"])
def test_stored_weights_match_f32_storage(arch, file_dtype, stored, text, tmp_path, monkeypatch):
    monkeypatch.setattr(Rows, "BLOCK", 37)  # the embedding arrives in several blocks of rows
    monkeypatch.setattr(layers, "Q8_INT8_ACTIVATIONS", False)  # float32 activations here (int8: test_q8_weights.py)
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", file_dtype, path, seed=3)
    # by default the weights stay in the file's form; the KV caches alike in both (float16 is their default
    # beside 16- and 8-bit weights, tested in test_kv_dtype.py)
    kept = LLM(path, max_len=128, kv_dtype=torch.float32)
    f32 = LLM(path, max_len=128, weight_dtype=torch.float32, kv_dtype=torch.float32)
    linears = [m.weight for m in kept.model.modules() if isinstance(m, Linear)]
    assert kept.model.embed.weight.dtype == stored and f32.model.embed.weight.dtype == torch.float32
    table = open_checkpoint(path).load("token_embd.weight")  # read whole, not in blocks
    assert torch.equal(dequantize(kept.model.embed.weight, torch.float32), table)
    assert torch.equal(f32.model.embed.weight, table)
    assert sum(w.dtype == stored for w in linears) > len(linears) // 2
    ids = kept.tokenizer.encode(text)
    kept_logits, f32_logits = kept.score(ids), f32.score(ids)  # prefill: float32 rounding apart (other kernels);
    # measured up to 1.6e-5 of the logits' std (the MoE models, Q8_0), where a wrong block or row moves them by ~1
    assert (kept_logits - f32_logits).abs().max() < 5e-5 * f32_logits.std()
    a = kept.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)  # decode
    b = f32.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)
    assert a.token_ids == b.token_ids
    step_kept = kept.runner.forward([0], [[a.token_ids[-1]]])
    step32 = f32.runner.forward([0], [[b.token_ids[-1]]])
    torch.testing.assert_close(step_kept, step32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "kimi-linear"])
def test_f16_prefill_matches_float64(arch, tmp_path):
    """A long prompt in one pass (every projection a GEMM of hundreds of rows: ops/csrc/f16gemm.h; the experts' rows
    too) on the float16 weights as stored, against float64 activations on the same weights: float32's error only.
    (Measured 1.8e-5 to 8.8e-5 max|diff|/std here, as the float32 GEMM on widened weights gives.)"""
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", "f16", path, seed=3)
    kept = LLM(path, max_len=512, kv_dtype=torch.float32)
    linears = [m.weight for m in kept.model.modules() if isinstance(m, Linear)]
    assert sum(w.dtype == torch.float16 for w in linears) > len(linears) // 2
    ids = kept.tokenizer.encode("The weights are stored in half precision, the sums are not. " * 8)
    assert len(ids) > 200
    ref = LLM(path, max_len=512, dtype=torch.float64, kv_dtype=torch.float64).score(ids).double()
    got = kept.score(ids).double()
    assert float((got - ref).abs().max() / ref.std()) < 2e-4


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_f16_hf_dir_keeps_float16(arch, tmp_path):
    """A transformers checkpoint in float16 keeps its matmul weights float16 with the file's values (the rest
    float32), and gives what the same directory widened to float32 gives: prefill, greedy decode."""
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", "f16", path, seed=5)
    src = LLM(path, max_len=128, weight_dtype=torch.float32, kv_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)  # the preset's values fit bfloat16: moved off it, as trained weights are
    params = {n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in src.model.state_dict().items()}
    write_hf_dir(tmp_path / "hf", src.model.config, params, src.tokenizer, dtype=torch.float16)
    kept = LLM(tmp_path / "hf", max_len=128, kv_dtype=torch.float32)
    f32 = LLM(tmp_path / "hf", max_len=128, weight_dtype=torch.float32, kv_dtype=torch.float32)
    linears = [m.weight for m in kept.model.modules() if isinstance(m, Linear)]
    assert all(w.dtype in (torch.float16, torch.bfloat16) for w in linears)  # bfloat16 where that is exact
    assert sum(w.dtype == torch.float16 for w in linears) > len(linears) // 2
    assert kept.model.embed.weight.dtype == torch.float16
    assert torch.equal(kept.model.embed.weight.float(), f32.model.embed.weight)
    norms = [p for n, p in kept.model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    ids = kept.tokenizer.encode("The weights are stored in half precision, the sums are not.")
    kept_logits, f32_logits = kept.score(ids), f32.score(ids)  # float32 sums in other orders (other kernels):
    # measured 1.0e-5 and 1.6e-5 of the logits' std (qwen35, qwen35moe), where a wrong value moves them by ~1
    assert (kept_logits - f32_logits).abs().max() < 5e-5 * f32_logits.std()
    a = kept.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
    b = f32.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert a.token_ids == b.token_ids
