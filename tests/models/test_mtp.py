"""The multi-token-prediction layer: read from a transformers checkpoint's `mtp.*` tensors and checked against
a float64 reference written here from the published description (DeepSeek-V3's MTP as Qwen3-Next / Qwen3.5
use it; vLLM's qwen3_next_mtp.py, llama.cpp's qwen35.cpp graph): entry p reads the trunk's final-normed hidden
state after token p-1 (zeros before token 0) and the embedding of token p,

    g_p = norm(layer(fc([enorm(embed(x_p)) | hnorm(h_{p-1})])))        logits_p = lm_head(g_p)

with a full-attention decoder layer of its own. The trunk's hidden states come from transformers; the MTP
tensors are read straight from the safetensors file, zero-centred norms and all.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deltaserve.loader import open_checkpoint
from deltaserve.models import QwenModel
from deltaserve.models.mtp import draft_step, sequence_logits

F32 = dict(weight_dtype=torch.float32, kv_dtype=torch.float32)


@pytest.fixture(scope="module")
def with_mtp(tiny, tmp_path_factory):
    """(checkpoint dir, its tensors): the tiny transformers checkpoint plus an MTP layer under `mtp.*`, its
    decoder layer a perturbed copy of the full-attention layer 3 (so MoE layouts are the family's own)."""
    path = tmp_path_factory.mktemp(f"mtp-{tiny.family}")
    shutil.copytree(tiny.path, path, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    E = tiny.model.config.hidden_size
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.3."):
            tensors["mtp.layers.0." + name.removeprefix("model.layers.3.")] = t + 0.1 * torch.randn(t.shape, generator=gen)
    tensors["mtp.fc.weight"] = torch.randn(E, 2 * E, generator=gen) * (2 * E) ** -0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: multiplier 1 + w
        tensors[f"mtp.{name}.weight"] = 0.3 * torch.randn(E, generator=gen)
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path, {n: t.double() for n, t in tensors.items()}


def rms(x, w, eps):  # zero-centred RMSNorm, as Qwen3-Next / Qwen3.5 checkpoints store it
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x, positions, rot, theta):
    """NeoX rotation of the first `rot` channels of each head; x [T, heads, d]."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = positions.double()[:, None] * inv  # [T, rot/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def reference_mtp(cfg, W, ids, hidden):
    """float64 MTP entries of tokens ids [T] after hidden states hidden [T, E] -> (g [T, E], logits [T, V])."""
    eps, E = cfg.rms_norm_eps, cfg.hidden_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    P = "mtp.layers.0."
    T = len(ids)
    emb = W["model.embed_tokens.weight"][ids]
    x = torch.cat([rms(emb, W["mtp.pre_fc_norm_embedding.weight"], eps),
                   rms(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1) @ W["mtp.fc.weight"].T
    a = rms(x, W[P + "input_layernorm.weight"], eps)
    qg = (a @ W[P + "self_attn.q_proj.weight"].T).view(T, nh, 2 * hd)  # per head [query | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = (a @ W[P + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
    v = (a @ W[P + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
    pos, rot = torch.arange(T), int(hd * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    q = rope(rms(q, W[P + "self_attn.q_norm.weight"], eps), pos, rot, theta)
    k = rope(rms(k, W[P + "self_attn.k_norm.weight"], eps), pos, rot, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * hd) * torch.sigmoid(gate)
    x = x + o @ W[P + "self_attn.o_proj.weight"].T
    x = x + reference_ffn(cfg, W, P + "mlp.", rms(x, W[P + "post_attention_layernorm.weight"], eps))
    g = rms(x, W["mtp.norm.weight"], eps)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return g, g @ head.T


def reference_ffn(cfg, W, p, x):
    def swiglu(prefix, x):
        return (F.silu(x @ W[prefix + "gate_proj.weight"].T) * (x @ W[prefix + "up_proj.weight"].T)) \
            @ W[prefix + "down_proj.weight"].T
    if p + "gate.weight" not in W:
        return swiglu(p, x)
    probs = (x @ W[p + "gate.weight"].T).softmax(-1)
    top, idx = probs.topk(cfg.num_experts_per_tok, dim=-1)
    top = top / top.sum(-1, keepdim=True)  # both MoE families here renormalise the top-k
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top[t], idx[t].tolist()):
            out[t] += w * swiglu(f"{p}experts.{e}.", x[t:t + 1])[0]
    shared = swiglu(p + "shared_expert.", x) * torch.sigmoid(x @ W[p + "shared_expert_gate.weight"].T)
    return out + shared


def trunk_hidden(tiny, ids):
    """transformers' final-normed hidden states, float64 [T, E]."""
    model = copy.deepcopy(tiny.model).double()
    with torch.no_grad():
        return model.model(ids[None]).last_hidden_state[0]


def rel_err(ours, ref):
    return float((ours.double() - ref).abs().max() / ref.abs().max())


IDS = torch.randint(0, 307, (23,), generator=torch.Generator().manual_seed(3))


def test_mtp_layer_matches_the_float64_reference(tiny, with_mtp):
    path, W = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path))
    assert model.mtp is not None
    h = trunk_hidden(tiny, IDS)
    before = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    _, ref = reference_mtp(tiny.model.config, W, IDS, before)
    with torch.no_grad():
        trunk, mtp = sequence_logits(model, IDS[None])
    assert ref.std() > 0.1 and rel_err(mtp[0], ref) < 1e-4
    assert (mtp[0] - trunk[0]).abs().max() > 0.1  # a prediction of its own, not the trunk's


@pytest.mark.parametrize("pass_tokens", [None, 4], ids=["one-pass", "passes-of-4"])
def test_cached_mtp_and_chained_drafts_match_the_reference(tiny, with_mtp, pass_tokens):
    """The trunk fed in uneven chunks (each in passes of 4 tokens, too) keeps the MTP cache in step; draft steps
    then extend it: the first reads the trunk's last hidden state, the next the MTP layer's own output with the
    drafted token."""
    path, W = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path), **F32)
    if pass_tokens:
        model.pass_tokens = pass_tokens
    T = len(IDS) - 1
    state = model.new_state(2, 40, mtp=True)
    for a, b in ((0, 5), (5, 6), (6, T)):
        model(IDS[None, a:b], state, [1])
    slots = torch.tensor([1])
    logits1, g = draft_step(model, state, slots, IDS[None, T:], state.conv[-1][slots], 0)
    d = int(logits1.argmax())
    logits2, _ = draft_step(model, state, slots, torch.tensor([[d]]), g, 1)
    h = trunk_hidden(tiny, IDS[:T])
    g_ref, ref = reference_mtp(tiny.model.config, W, IDS, torch.cat([torch.zeros_like(h[:1]), h]))
    assert rel_err(logits1[0], ref[T]) < 1e-4
    _, ref2 = reference_mtp(tiny.model.config, W, torch.cat([IDS, torch.tensor([d])]),
                            torch.cat([torch.zeros_like(h[:1]), h, g_ref[T:]]))
    assert rel_err(logits2[0], ref2[T + 1]) < 1e-4
    assert int(state.lengths[1]) == T  # drafting leaves the trunk where it was


def test_a_checkpoint_without_the_whole_mtp_layer_loads_the_trunk(tiny, with_mtp, tmp_path):
    path, _ = with_mtp
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    model = QwenModel.from_checkpoint(open_checkpoint(tmp_path))
    assert model.mtp is None and model.config.mtp_layers == 1
    with pytest.raises(Exception, match="no MTP layer"):
        model.new_state(1, 8, mtp=True)


# -- the layout in both formats ---------------------------------------------------------------------

ARCHES = ("qwen35", "qwen35moe", "qwen3next")
# llama.cpp's converter (conversion/qwen.py, _QwenMtpMixin.filter_tensors): the MTP layer becomes block n after
# the trunk's n blocks; its own tensors are renamed so, the decoder layer's map as a trunk block's do
NEXTN = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
         "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from deltaserve import convert

    root, cache = tmp_path_factory.mktemp("mtp-made"), {}

    def get(arch):
        if arch not in cache:
            cache[arch] = convert.make_model(arch, "tiny", "f32", root / f"{arch}.gguf", seed=5,
                                             hf_dir=root / f"{arch}-hf", mtp=True)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ARCHES)
def test_mtp_layer_reads_the_same_from_both_formats_and_writes_back_bit_exact(arch, made, tmp_path):
    import numpy as np
    from gguf import GGUFReader

    from deltaserve import convert
    from deltaserve.models import load_model

    m = made(arch)
    from_gguf, from_hf = (load_model(open_checkpoint(p), **F32) for p in (m.gguf_path, m.hf_dir))
    assert from_gguf.mtp is not None and from_hf.mtp is not None
    ids = torch.randint(0, from_gguf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = sequence_logits(from_gguf, ids)[1], sequence_logits(from_hf, ids)[1]
    assert b.std() > 0.05
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
    again = convert.write_gguf(tmp_path / "again.gguf", from_gguf.config, from_gguf.state_dict(), m.tokenizer, "f32")
    before = {t.name: np.array(t.data) for t in GGUFReader(m.gguf_path).tensors}
    after = {t.name: np.array(t.data) for t in GGUFReader(again).tensors}
    assert any(n.startswith("blk.4.nextn.") for n in before)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    convert.write_hf_dir(tmp_path / "hf", from_hf.config, from_hf.state_dict(), m.tokenizer, dtype=torch.float32)
    back = load_model(open_checkpoint(tmp_path / "hf"), **F32)
    theirs = dict(back.named_parameters())
    assert all(torch.equal(theirs[n], p) for n, p in from_hf.named_parameters() if n.startswith("mtp."))


def test_gguf_mtp_block_is_the_hf_mtp_layer_converted_as_llama_cpp_does(made):
    """Tensor by tensor: block 4 of the GGUF holds the Hugging Face `mtp.*` tensors under the converter's
    names (gguf-py's map for the decoder layer), every `*norm.weight` of the renamed tensors + 1."""
    import gguf
    import numpy as np
    from gguf import GGUFReader

    m = made("qwen35")
    hf = load_file(m.hf_dir / "model.safetensors")
    gg = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(m.gguf_path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 5)
    mtp = [n for n in hf if n.startswith("mtp.")]
    assert len(mtp) == 4 + 11  # fc, 3 norms; 2 layer norms, q/k/v/o, q/k norms, gate/up/down
    for name in mtp:
        if name in NEXTN:
            target = "blk.4." + NEXTN[name]
        else:
            stem = "model.layers.4." + name.removeprefix("mtp.layers.0.").removesuffix(".weight")
            target = names.get_name(stem) + ".weight"
        want = hf[name].float() + (1 if target.endswith("norm.weight") else 0)  # the converter's rule, renamed
        assert torch.equal(gg[target].reshape(want.shape), want), name
