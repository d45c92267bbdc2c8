"""`make-model --arch kimi-linear` against independent references: the tensors and ne shapes that llama.cpp's
src/models/kimi-linear.cpp creates when it loads, the converter's transforms (conversion/kimi_linear.py)
recomputed here head by head, transformers loading the Hugging Face copy, and llama.cpp itself running the
GGUF (last-token logits and 32 greedy tokens against deltaserve)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from safetensors.torch import load_file

from deltaserve.bench.llama_peer import open_llama
from deltaserve.convert import make_model
from deltaserve.convert.presets import preset_config
from deltaserve.engine.llm import LLM
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import KimiConfig, KimiModel
from tests.convert.test_make import field, read_gguf, run_cli

PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(dtype) -> MadeModel of the tiny preset, seed 5; the f32 one with a Hugging Face copy."""
    root, cache = tmp_path_factory.mktemp("kimi-made"), {}

    def get(dtype="f32"):
        if dtype not in cache:
            hf_dir = root / "hf" if dtype == "f32" else None
            cache[dtype] = make_model("kimi-linear", "tiny", dtype, root / f"kimi-{dtype}.gguf", seed=5, hf_dir=hf_dir)
        return cache[dtype]
    return get


def dense_layers(c: KimiConfig) -> int:
    """How many leading layers have a dense MLP (llama.cpp's leading_dense_block_count)."""
    return next((i for i, t in enumerate(c.ffn_types) if t != "dense"), c.num_layers)


def llama_cpp_tensors(c: KimiConfig) -> dict[str, tuple[int, ...]]:
    """ne of every tensor llama.cpp's kimi-linear load_arch_tensors creates (3-D/4-D convs and ssm_a as
    written by the converter: {W, 1, C, 1} and {1, H, 1, 1}; read_gguf drops trailing 1s)."""
    assert c.kda_heads == c.num_heads  # llama.cpp has one attention.head_count for both
    E, H, D, V, C = c.hidden_size, c.num_heads, c.kda_head_dim, c.vocab_size, c.kda_dim
    R, dn, dr, dv = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    want = {"token_embd.weight": (E, V), "output_norm.weight": (E,), "output.weight": (E, V)}
    for i in range(c.num_layers):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (E,), b + "ffn_norm.weight": (E,)}
        if (i + 1) % 4:  # KDA
            want |= {b + f"ssm_conv1d_{x}.weight": (c.conv_kernel, 1, C) for x in "qkv"}
            want |= {b + f"attn_{x}.weight": (E, C) for x in "qkv"}
            want |= {b + "ssm_f_a.weight": (E, D), b + "ssm_f_b.weight": (D, C), b + "ssm_beta.weight": (E, H),
                     b + "ssm_a": (1, H), b + "ssm_dt.bias": (C,), b + "ssm_g_a.weight": (E, D),
                     b + "ssm_g_b.weight": (D, C), b + "ssm_norm.weight": (D,), b + "attn_output.weight": (C, E)}
        else:  # MLA with the split kv_b (MLA KV cache enabled)
            want |= {b + "attn_q.weight": (E, H * (dn + dr)), b + "attn_kv_a_mqa.weight": (E, R + dr),
                     b + "attn_kv_a_norm.weight": (R,), b + "attn_k_b.weight": (dn, R, H),
                     b + "attn_v_b.weight": (R, dv, H), b + "attn_output.weight": (H * dv, E)}
        if i < dense_layers(c):
            F = c.intermediate_size
            want |= {b + "ffn_gate.weight": (E, F), b + "ffn_up.weight": (E, F), b + "ffn_down.weight": (F, E)}
        else:
            X, F, S = c.num_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.num_shared_experts
            want |= {b + "ffn_gate_inp.weight": (E, X), b + "ffn_gate_exps.weight": (E, F, X),
                     b + "ffn_up_exps.weight": (E, F, X), b + "ffn_down_exps.weight": (F, E, X),
                     b + "exp_probs_b.bias": (X,), b + "ffn_gate_shexp.weight": (E, S),
                     b + "ffn_up_shexp.weight": (E, S), b + "ffn_down_shexp.weight": (S, E)}
    return want


def test_tensors_are_the_ones_llama_cpp_loads(made):
    m = made()
    got = {name: ne for name, (ne, _, _) in read_gguf(m.gguf_path).items()}
    assert got == llama_cpp_tensors(m.config)


def test_metadata(made):
    m = made()
    reader = GGUFReader(m.gguf_path)
    assert field(reader, "general.architecture") == "kimi-linear"
    want = {
        "block_count": 4, "embedding_length": 96, "feed_forward_length": 160, "attention.head_count": 3,
        "attention.head_count_kv": [0, 0, 0, 1], "ssm.conv_kernel": 4, "kda.head_dim": 32,
        "attention.kv_lora_rank": 64, "rope.dimension_count": 32, "attention.key_length": 64 + 32,
        "attention.key_length_mla": 32 + 32, "attention.value_length_mla": 64, "expert_count": 8,
        "expert_used_count": 2, "expert_feed_forward_length": 64, "expert_shared_count": 1,
        "leading_dense_block_count": 1, "expert_gating_func": 2, "vocab_size": m.config.vocab_size,
    }
    for key, value in want.items():
        assert field(reader, f"kimi-linear.{key}") == value, key
    assert field(reader, "kimi-linear.expert_weights_scale") == pytest.approx(2.446)
    assert field(reader, "kimi-linear.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert "kimi-linear.attention.q_lora_rank" not in reader.fields  # Kimi-Linear has a full-rank q


def test_gguf_is_the_converted_hf_checkpoint(made):
    m = made()
    c = m.config
    hf = {k: v.float().numpy() for k, v in load_file(m.hf_dir / "model.safetensors").items()}
    gg = {name: data for name, (_, _, data) in read_gguf(m.gguf_path).items()}
    H, dn, dv = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    np.testing.assert_array_equal(gg["output.weight"], hf["lm_head.weight"])
    np.testing.assert_array_equal(gg["output_norm.weight"], hf["model.norm.weight"])  # Kimi norms: no +1
    for i in range(c.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        np.testing.assert_array_equal(gg[b + "ffn_norm.weight"], hf[p + "post_attention_layernorm.weight"])
        if (i + 1) % 4:
            for x in "qkv":
                np.testing.assert_array_equal(gg[b + f"ssm_conv1d_{x}.weight"].reshape(c.kda_dim, -1),
                                              hf[a + f"{x}_conv1d.weight"][:, 0, :])
                np.testing.assert_array_equal(gg[b + f"attn_{x}.weight"], hf[a + f"{x}_proj.weight"])
            np.testing.assert_allclose(gg[b + "ssm_a"].ravel(), -np.exp(hf[a + "A_log"].ravel()), rtol=1e-6)
            np.testing.assert_array_equal(gg[b + "ssm_dt.bias"], hf[a + "dt_bias"])
            np.testing.assert_array_equal(gg[b + "ssm_beta.weight"], hf[a + "b_proj.weight"])
            np.testing.assert_array_equal(gg[b + "ssm_norm.weight"], hf[a + "o_norm.weight"])
        else:
            kv_b = hf[a + "kv_b_proj.weight"]  # [H * (dn + dv), R], per head [k_nope | v]
            for h in range(H):
                rows = kv_b[h * (dn + dv):(h + 1) * (dn + dv)]
                np.testing.assert_array_equal(gg[b + "attn_k_b.weight"][h], rows[:dn].T)  # numpy [H, R, dn]
                np.testing.assert_array_equal(gg[b + "attn_v_b.weight"][h], rows[dn:])  # numpy [H, dv, R]
            np.testing.assert_array_equal(gg[b + "attn_kv_a_mqa.weight"], hf[a + "kv_a_proj_with_mqa.weight"])
        if i >= dense_layers(c):
            moe = p + "block_sparse_moe."
            np.testing.assert_array_equal(gg[b + "exp_probs_b.bias"], hf[moe + "gate.e_score_correction_bias"])
            for x in range(c.num_experts):
                for w, name in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                    np.testing.assert_array_equal(gg[b + f"ffn_{name}_exps.weight"][x],
                                                  hf[moe + f"experts.{x}.{w}.weight"])


def test_q8_0_keeps_the_converter_f32_tensors(made):
    q8 = read_gguf(made("q8_0").gguf_path)
    for name, (_, qtype, _) in q8.items():
        small = name.endswith(("_norm.weight", ".bias", "ssm_a", "ffn_gate_inp.weight")) or "ssm_conv1d_" in name
        assert (qtype == Q.F32) == small, name  # every other matrix's rows split into 32-blocks
    assert q8["blk.0.attn_q.weight"][1] == Q.Q8_0


def test_both_copies_load_to_the_same_model_and_transformers_agrees(made):
    transformers = pytest.importorskip("transformers")
    m = made()
    from_gguf = KimiModel.from_checkpoint(open_checkpoint(m.gguf_path))
    from_hf = KimiModel.from_checkpoint(open_checkpoint(m.hf_dir))
    gguf_params = dict(from_gguf.named_parameters())
    for name, p in from_hf.named_parameters():
        torch.testing.assert_close(gguf_params[name], p, rtol=1e-6, atol=0, msg=name)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(m.hf_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "KimiLinearForCausalLM" and not any(info.values()), info
    ids = torch.tensor([m.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        ref = model(ids).logits
    got = from_hf(ids, from_hf.new_state(1, ids.shape[1]), [0], logits="all")
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
    assert ref.std(-1).min() > 0.05 and len(set(ref[0].argmax(-1).tolist())) > ids.shape[1] // 2


# -- llama.cpp ------------------------------------------------------------------------------------

def llama(path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")
    return open_llama(path, n_ctx=256, n_batch=256, logits_all=True, verbose=False, seed=0)


def rel_diff(mine, theirs):
    return np.abs(mine - theirs).max() / theirs.std()


def test_llama_cpp_logits_and_greedy_tokens(made):
    f16, f32 = made("f16"), made("f32")
    ref, ref32 = llama(f16.gguf_path), llama(f32.gguf_path)
    ours = LLM(f16.gguf_path, max_len=256, prefill_chunk=7)
    ids = ours.tokenizer.encode(PROMPT)
    assert ids == ref.tokenize(PROMPT.encode(), add_bos=False, special=True)
    mine = ours.score(ids)[-1].double().numpy()
    for llm in (ref, ref32):
        llm.eval(ids)
    # ours computes the f16 weights in float32, as llama.cpp does on the f32 file; llama.cpp's f16 path
    # also rounds activations to f16, which moves its own logits by 3e-3..3e-2 of their spread depending
    # on the seed's weights: ours may differ from it by that much and the f32 difference, no more
    theirs32 = np.asarray(ref32.scores[len(ids) - 1], dtype=np.float64)
    theirs16 = np.asarray(ref.scores[len(ids) - 1], dtype=np.float64)
    assert rel_diff(mine, theirs32) < 1e-3
    assert rel_diff(theirs32, theirs16) < 5e-2
    assert rel_diff(mine, theirs16) < rel_diff(theirs32, theirs16) + 1e-3

    theirs = []  # llama.cpp's greedy continuation on the f32 file (its f16 run may part from its own f32 run
    for _ in range(32):  # at a close call, see test_llama_cpp_parity.py), one token per step on its own cache
        theirs.append(int(np.argmax(ref32.scores[ref32.n_tokens - 1])))
        ref32.eval([theirs[-1]])
    assert ours.generate(ids, max_tokens=32, temperature=0, ignore_eos=True).token_ids == theirs
    assert len(set(theirs)) > 4
    ref.close()
    ref32.close()


# -- presets and arguments ------------------------------------------------------------------------

def test_small_preset_shapes():
    c = preset_config("kimi-linear", "small", 1024)
    assert (c.kda_head_dim, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == \
        (128, 512, 128, 64, 128)  # Kimi-Linear-48B-A3B's head sizes
    assert [c.layer_types[i] == "linear_attention" for i in range(c.num_layers)] == [True, True, True, False] * 2


@pytest.mark.parametrize("kwargs, problem", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be in \[1, num_experts=8\]"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive integer, got 0"),
], ids=["experts-used", "latent"])
def test_bad_shape_is_refused(kwargs, problem):
    base = dict(vocab_size=1000, hidden_size=96, layer_types=("linear_attention",) * 3 + ("full_attention",),
                ffn_types=("dense",) + ("moe",) * 3, rms_norm_eps=1e-5, conv_kernel=4, kda_heads=3, kda_head_dim=32,
                num_heads=3, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                intermediate_size=160, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                num_shared_experts=1)
    KimiConfig(**base)  # the base is fine
    with pytest.raises(DeltaserveError, match=problem):
        KimiConfig(**(base | kwargs))


def test_command_line_and_presets(tmp_path, capsys):
    out = tmp_path / "k.gguf"
    assert run_cli(["make-model", "--arch", "kimi-linear", "--preset", "tiny", "--dtype", "q8_0", str(out)]) == 0
    assert field(GGUFReader(out), "general.architecture") == "kimi-linear"
    assert "wrote" in capsys.readouterr().err
    with pytest.raises(DeltaserveError, match="unknown preset 'small' for qwen35"):
        make_model("qwen35", "small", "f16", tmp_path / "q.gguf")
    with pytest.raises(DeltaserveError, match="unknown preset '0.8b' for kimi-linear"):
        make_model("kimi-linear", "0.8b", "f16", tmp_path / "q.gguf")
