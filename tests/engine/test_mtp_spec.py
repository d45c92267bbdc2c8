"""Speculative decoding with the model's own multi-token-prediction layer (`speculative="mtp"`).

Random MTP weights draft badly, which checks that the trunk's verification and rollback (recurrent state,
KV cache, the MTP layer's own cache) keep the output exactly plain decoding's. An "aligned" model, whose trunk
mostly predicts from the current token and whose MTP layer predicts exactly that, drafts well, which checks
that the drafts are made from the right tokens and hidden states and that accepted ones are kept.
"""

from __future__ import annotations

import re

import pytest
import torch

from deltaserve import convert
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import LLM, load
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError

from tests.engine.runs import run_to_end

ARCHES = ("qwen35", "qwen35moe", "qwen3next")
GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = "the cat sat on the mat and the dog sat on the log; the cat sat"


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    """(arch, aligned) -> a tiny f32 GGUF with an MTP layer: random, or aligned (see the module docstring)."""
    root, made = tmp_path_factory.mktemp("mtp-spec"), {}

    def get(arch: str, aligned: bool = False):
        if (arch, aligned) not in made:
            path = root / f"{arch}-{aligned}.gguf"
            m = convert.make_model(arch, "tiny", "f32", path, seed=5, mtp=True)
            if aligned:
                model, _ = load(path)
                convert.write_gguf(path, model.config, _aligned(model.state_dict()), m.tokenizer, "f32")
            made[arch, aligned] = path
        return made[arch, aligned]
    return get


def _aligned(params: dict[str, torch.Tensor], eps: float = 0.003) -> dict[str, torch.Tensor]:
    """The trunk's layers scaled down to eps of their output, so the final hidden state is mostly the current
    token's normed embedding (the random layers' outputs are ~50x the embedding's: at eps 0.003 about 45% of
    qwen35moe's drafts are taken); the MTP layer passes its normed embedding through (fc = [I | 0], attention and
    feed-forward outputs zero) to the trunk's final norm: it predicts what the trunk predicts after the token."""
    out = {}
    for name, p in params.items():
        p = p.clone()
        if re.match(r"layers\.\d+\.(mixer\.(out_proj|o_proj)|ffn\.(.*\.)?down)", name):
            p *= eps
        elif re.match(r"mtp\.layer\.(mixer\.o_proj|ffn\.(.*\.)?down)", name):
            p.zero_()
        out[name] = p
    E = params["mtp.fc.weight"].shape[0]
    out["mtp.fc.weight"] = torch.cat([torch.eye(E), torch.zeros(E, E)], dim=1)
    out["mtp.enorm.weight"] = torch.ones(E)
    out["mtp.norm.weight"] = params["norm.weight"].clone()
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_mtp_greedy_output_equals_plain_greedy(arch, mtp_path):
    """k = 1..4, with prefix checkpoints every 16 tokens, and a follow-up prompt that restores them."""
    llm = LLM(mtp_path(arch), max_len=200, prefill_chunk=24, checkpoint_interval=16)
    plain = llm.generate(PROMPT, max_tokens=45, speculative=False, **GREEDY)
    follow = llm.tokenizer.encode(PROMPT) + plain.token_ids[:30] + llm.tokenizer.encode(" and then")
    plain_follow = llm.generate(follow, max_tokens=30, speculative=False, **GREEDY)
    for k in (1, 2, 3, 4):
        llm.spec_tokens = k
        llm.speculators.clear()
        out = llm.generate(PROMPT, max_tokens=45, speculative="mtp", **GREEDY)
        assert (out.token_ids, out.finish_reason) == (plain.token_ids, plain.finish_reason), k
        assert llm.generate(follow, max_tokens=30, speculative="mtp", **GREEDY).token_ids == plain_follow.token_ids
        s = llm.speculators["mtp"]
        assert s.steps > 0 and s.proposed >= s.steps and s.accepted <= s.proposed


def test_aligned_mtp_drafts_are_accepted_and_output_is_unchanged(mtp_path):
    llm = LLM(mtp_path("qwen35moe", aligned=True), max_len=200, prefill_chunk=24, checkpoint_interval=16)
    plain = llm.generate(PROMPT, max_tokens=60, speculative=False, **GREEDY)
    llm.spec_tokens = 3
    out = llm.generate(PROMPT, max_tokens=60, speculative="mtp", **GREEDY)
    s = llm.speculators["mtp"]
    assert out.token_ids == plain.token_ids
    assert 0.2 < s.acceptance_rate < 1 and s.steps < 0.8 * len(out.token_ids)  # drafts taken and refused


@pytest.mark.parametrize("arch, max_batch", [("qwen35moe", None), ("qwen3next", 2)])
def test_batched_mtp_requests_each_get_their_plain_output(arch, max_batch, mtp_path):
    """Every slot drafting, or (max_batch 2) steps of three sequences decoding plainly and steps of fewer
    drafting: either way each request gets its plain greedy output."""
    prompts = ["a b a b a b a b", "one two three one two three one", "Quietly", PROMPT]
    solo = LLM(mtp_path(arch), max_len=128)
    want = [solo.generate(p, max_tokens=25, **GREEDY).token_ids for p in prompts]
    model, tokenizer = load(mtp_path(arch))
    engine = Engine(model, tokenizer, n_slots=3, max_len=128, prefill_chunk=8, checkpoint_interval=16,
                    speculative="mtp", spec_tokens=3, spec_max_batch=max_batch)
    # four requests over three slots: one waits, then reuses a slot
    done = run_to_end(engine, [tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=25, **GREEDY))
    assert [d.token_ids for d in done] == want
    assert engine.speculator.steps > 0
    assert (engine.scheduler.plain_steps > 0) == (max_batch is not None)  # three at once: no drafts


def test_sampled_mtp_output_follows_the_model_distribution(mtp_path):
    """At temperature 0.8 with top_k 2, the first two tokens take 4 values; over many seeds their frequencies
    must fit the probabilities computed from the model's own logits (chi-square, 3 degrees of freedom). The
    second token is the one speculation decides (a draft kept or refused)."""
    llm = LLM(mtp_path("qwen35moe", aligned=True), max_len=64, checkpoint_interval=0)
    kw = dict(max_tokens=3, temperature=0.8, top_k=2, ignore_eos=True, speculative="mtp")
    llm.spec_tokens = 2

    def top2(ids):
        logits = llm.score(ids)[-1] / 0.8
        best = logits.topk(2)
        return dict(zip(best.indices.tolist(), best.values.softmax(-1).tolist()))

    def cells(prompt):
        return {(a, b): pa * pb for a, pa in top2(prompt).items() for b, pb in top2(prompt + [a]).items()}

    # a prompt whose four outcomes are all likely enough for the test to see them (>= 15 expected each)
    prompts = [llm.tokenizer.encode(f"the {w} sat on the") for w in ("dog", "cat", "river", "train", "loaf")]
    prompt, expected = next((p, c) for p in prompts if min((c := cells(p)).values()) >= 0.05)
    n = 300
    counts = dict.fromkeys(expected, 0)
    for seed in range(n):
        ids = llm.generate(prompt, seed=seed, **kw).token_ids
        counts[ids[0], ids[1]] += 1
    s = llm.speculators["mtp"]
    assert 0 < s.accepted < s.proposed  # both ways of deciding the second token were taken
    chi2 = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in expected.items())
    assert chi2 < 16.27, (chi2, counts, expected)  # p = 0.001 for 3 degrees of freedom


def test_mtp_needs_a_model_with_an_mtp_layer(tmp_path):
    path = convert.make_model("qwen35", "tiny", "f32", tmp_path / "plain.gguf", seed=5).gguf_path
    with pytest.raises(DeltaserveError, match="no MTP layer"):
        LLM(path, max_len=32, speculative="mtp")
    llm = LLM(path, max_len=32)
    with pytest.raises(DeltaserveError, match="no MTP layer"):
        llm.generate("hi", max_tokens=2, speculative="mtp")
    assert llm.generate("hi", max_tokens=2, speculative=False).token_ids  # still serves plainly
