"""Fidelity at length: last-token logits after a long prompt against llama.cpp (llama-cpp-python) on the same
float32 file, both with float32 KV caches, within 5e-3 max|diff| / std. The prompt goes through deltaserve's
runner in 512-token passes as a server would feed it (its prefix checkpoints on), so the attention kernel
reads a cache thousands of keys long and the recurrent layers carry their state across every pass.
scripts/long_fidelity.py runs the same comparison at 128k tokens (and on 0.8B shapes) out of the suite.
"""

import numpy as np
import pytest

from deltaserve.bench.llama_peer import open_llama
from deltaserve.convert import make_model
from deltaserve.engine.llm import LLM

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")

GGML_TYPE_F32 = 0


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.default_rng(7).integers(vocab // 4, vocab // 2, n).tolist()


@pytest.mark.parametrize("arch, tokens", [("qwen35", 8192), ("kimi-linear", 3000)])
def test_last_token_logits_after_a_long_prompt(arch, tokens, tmp_path):
    path = tmp_path / f"{arch}-tiny-f32.gguf"
    make_model(arch, "tiny", "f32", path, seed=11)
    ours = LLM(path, max_len=tokens + 8, prefill_chunk=512)
    ids = _prompt(tokens, ours.model.config.vocab_size)
    for i in range(0, tokens, 512):
        logits = ours.runner.forward([0], [ids[i:i + 512]])
    mine = logits[0].double().numpy()
    assert ours.runner.cache.store.checkpoints > 0  # the passes were cut and checkpointed on the way

    ref = open_llama(path, n_ctx=tokens + 8, n_batch=512, n_ubatch=512, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                     verbose=False)
    try:
        ref.eval(ids)
        theirs = np.ctypeslib.as_array(ref._ctx.get_logits(), shape=(ref.n_vocab(),)).astype(np.float64)
    finally:
        ref.close()
    rel = np.abs(mine - theirs).max() / theirs.std()
    assert rel < 5e-3, f"max|diff|/std {rel:.2e} after {tokens} tokens"
