"""The one-call paths of speculative decoding (models/qwen/plan.py: the verify pass, the MTP layer's drafts and
cache writes) against transformers / the float64 MTP reference of test_mtp.py, and bit for bit against
the modules they replace, for the dense (qwen35) and the MoE families (qwen35moe, qwen3next)."""

from __future__ import annotations

import copy

import pytest
import torch

from deltaserve.engine.llm import DEFAULT_MODEL
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import QwenModel, load_model
from deltaserve.models.base import HybridModel
from deltaserve.models import mtp as mtp_layer
from deltaserve.models.layers import Q8_BLOCK, Linear, linear, q8_int8
from deltaserve.models.mtp import q8_0_copy
from deltaserve.models.mtp import draft
from tests.models.test_mtp import IDS, reference_mtp, rel_err, trunk_hidden, with_mtp  # noqa: F401 (fixture)

F32 = dict(weight_dtype=torch.float32, kv_dtype=torch.float32)


def reference_logits(tiny, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits over the whole sequence in float64 [T, V]."""
    model = copy.deepcopy(tiny.model).double()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def verify_run(model, prefixes: list[int], T: int):
    """Two sequences in slots 2 and 0 of three, holding IDS[:prefixes[n]], then one verify pass of T tokens each
    keeping T snapshots -> (logits [2, T, V], state)."""
    state = model.new_state(3, 40)
    for slot, p in zip((2, 0), prefixes):
        model(IDS[None, :p], state, [slot])
    rows = torch.stack([IDS[p:p + T] for p in prefixes])
    return model(rows, state, [2, 0], logits="all", snapshots=T), state


def test_verify_pass_matches_transformers_and_the_modules(tiny, with_mtp, monkeypatch):
    path, _ = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path), **F32)
    prefixes, T = [9, 4], 5
    logits, state = verify_run(model, prefixes, T)
    planned = any(key[0] == 0 and plan is not None for key, plan in model.__dict__["_decode_plans"].items())
    assert planned  # dense and MoE layers take the plan
    for n, p in enumerate(prefixes):
        assert rel_err(logits[n], reference_logits(tiny, IDS[:p + T])[p:]) < 1e-4

    monkeypatch.setattr(QwenModel, "decode_step", HybridModel.decode_step)  # the modules' path
    modules, by_modules = verify_run(model, prefixes, T)
    assert torch.equal(logits, modules)
    for ours, theirs in ((state.snapshots.conv, by_modules.snapshots.conv), (state.snapshots.ssm, by_modules.snapshots.ssm),
                         (state.ssm, by_modules.ssm), (state.k, by_modules.k)):
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("keep", [1, 3, 5])
def test_rollback_after_a_planned_verify_pass_continues_as_transformers(tiny, with_mtp, keep):
    """Keep `keep` of the 5 verified tokens, then feed the rest of the sequence: the logits are transformers'."""
    path, _ = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path), **F32)
    _, state = verify_run(model, [9, 4], 5)
    state.rollback(2, 9 + keep)
    out = model(IDS[None, 9 + keep:20], state, [2], logits="all")[0]
    assert rel_err(out, reference_logits(tiny, IDS[:20])[9 + keep:]) < 1e-4


def draft_run(model, ks: list[int]):
    """Slots 1 and 0 of two fed IDS[:14] and IDS[:9] in uneven chunks, then chained drafts -> (drafts, state)."""
    state = model.new_state(2, 40, mtp=True)
    for a, b in ((0, 5), (5, 6), (6, 14)):
        model(IDS[None, a:b], state, [1])
    model(IDS[None, :9], state, [0])
    return draft(model, state, torch.tensor([1, 0]), torch.stack([IDS[14], IDS[9]]), ks), state


@pytest.fixture
def float_drafts(monkeypatch):
    """The MTP plan reads the weights as stored, as the modules and the float64 reference do."""
    monkeypatch.setattr(mtp_layer, "DRAFT_Q8", False)


def test_chained_drafts_match_the_float64_mtp_and_the_modules(tiny, with_mtp, float_drafts, monkeypatch):
    path, W = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path), **F32)
    drafts, state = draft_run(model, [3, 1])
    assert [len(d) for d in drafts] == [3, 1]
    planned = any(key[0] == "mtp" and plan is not None for key, plan in model.__dict__["_decode_plans"].items())
    assert planned  # the MTP layer takes the plan, dense or MoE
    cfg = tiny.model.config
    for n, p in enumerate((14, 9)):  # each draft is the reference's argmax after the drafts before it
        h = trunk_hidden(tiny, IDS[:p])
        ids, hidden = IDS[:p + 1], torch.cat([torch.zeros_like(h[:1]), h])
        for d in drafts[n]:
            g, logits = reference_mtp(cfg, W, ids, hidden)
            assert d == int(logits[-1].argmax())
            ids, hidden = torch.cat([ids, torch.tensor([d])]), torch.cat([hidden, g[-1:]])

    monkeypatch.setattr(QwenModel, "mtp_draft", HybridModel.mtp_draft)  # the modules' path, step by step
    monkeypatch.setattr(QwenModel, "mtp_follow", HybridModel.mtp_follow)
    modules, by_modules = draft_run(model, [3, 1])
    assert modules == drafts
    i = len(model.layers)  # the MTP cache: the trunk's passes' entries, then the drafted ones (float32 weights: one
    # token's projection is MKL's GEMV in the module, its GEMM in the plan, a rounding apart)
    torch.testing.assert_close(state.k[i][:, :18], by_modules.k[i][:, :18], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.v[i][:, :18], by_modules.v[i][:, :18], rtol=1e-5, atol=1e-6)
    assert state.k[i][:, :18].abs().amax((-2, -1)).gt(0).sum() == 14 + 3 + 9 + 1  # every written row, no other


def test_chained_drafts_on_bfloat16_weights_match_the_modules(tiny, with_mtp, tmp_path, float_drafts, monkeypatch):
    """A bf16 checkpoint keeps its embedding and matmul weights bfloat16: the MTP plan takes it and
    drafts what the modules draft, step by step, on the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = with_mtp
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({n: t.bfloat16().contiguous() for n, t in tensors.items()}, tmp_path / "model.safetensors")
    model = QwenModel.from_checkpoint(open_checkpoint(tmp_path), weight_dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    drafts, _ = draft_run(model, [3, 2])
    planned = any(key[0] == "mtp" and plan is not None for key, plan in model.__dict__["_decode_plans"].items())
    assert planned
    monkeypatch.setattr(QwenModel, "mtp_draft", HybridModel.mtp_draft)
    monkeypatch.setattr(QwenModel, "mtp_follow", HybridModel.mtp_follow)
    assert draft_run(model, [3, 2])[0] == drafts


def test_q8_0_copy_holds_the_values_of_ggml_q8_0_blocks():
    """The draft copies (q8_0_copy, in slices of rows) are gguf-py's Q8_0 blocks of the weight: its codes times its
    scales are gguf-py's dequantisation of ggml's quantisation (itself checked bit-exact in tests/loader)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    w = (torch.randn(37, 96, generator=torch.Generator().manual_seed(1)) * 0.2).half()
    q = q8_0_copy(w, rows_per_pass=10)
    ours = (q.float().view(37, 3, 32) * q.scale.float()[..., None]).view(37, 96)
    blocks = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
    assert q.dtype == torch.int8 and q.scale.dtype == torch.float16
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float32)))


@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the embedded model is not built in this checkout")
def test_chained_drafts_through_q8_0_copies_are_the_modules_on_those_copies(monkeypatch):
    """By default the plan drafts through Q8_0 copies of the MTP layer's float weights and of the head (the tiny
    models' odd widths have no Q8_0 form, so the embedded model, float16, 256 wide): its drafts and MTP cache,
    a 20-token prompt pass included, are those of the modules holding the same copies (ggml's rounding, checked
    against gguf-py in tests/loader), bit for bit, and not those of the float weights."""
    if not q8_int8(torch.empty(0, Q8_BLOCK)):
        pytest.skip("this build has no Q8_0 integer kernels (AVX-512 VNNI or AVX2): the plan keeps the float weights")
    model = QwenModel.from_checkpoint(open_checkpoint(DEFAULT_MODEL))
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))

    def run():
        state = model.new_state(2, 64, mtp=True)
        for slot, (a, b) in ((1, (0, 20)), (1, (20, 23)), (0, (0, 9))):
            model(ids[None, a:b], state, [slot])
        return draft(model, state, torch.tensor([1, 0]), ids[[23, 9]], [3, 2]), state.k[-1], state.v[-1]

    drafts, keys, values = run()
    with monkeypatch.context() as float_plan:
        float_plan.setattr(mtp_layer, "DRAFT_Q8", False)
        assert not torch.equal(keys, run()[1])

    for module in model.mtp.modules():
        if isinstance(module, Linear):
            q = q8_0_copy(module.weight)
            module.weight = torch.nn.Parameter(q, requires_grad=False)
            module.weight.scale = q.scale
    head = q8_0_copy(model.embed.weight if model.lm_head is None else model.lm_head.weight)
    monkeypatch.setattr(mtp_layer, "lm_logits", lambda model, h: linear(h, head).float())
    monkeypatch.setattr(QwenModel, "mtp_draft", HybridModel.mtp_draft)
    monkeypatch.setattr(QwenModel, "mtp_follow", HybridModel.mtp_follow)
    by_modules = run()
    assert by_modules[0] == drafts and torch.equal(by_modules[1], keys) and torch.equal(by_modules[2], values)


def decode_run(model, prefixes: list[int], steps: int):
    """Sequences in slots 2, 0 and 1 of three holding IDS[:prefixes[n]], then `steps` decode steps of all of them
    on the following ids -> (logits [steps, N, V], state)."""
    state = model.new_state(3, 40)
    slots = [2, 0, 1][:len(prefixes)]
    for slot, p in zip(slots, prefixes):
        model(IDS[None, :p], state, [slot])
    out = [model(torch.stack([IDS[p + s:p + s + 1] for p in prefixes]), state, slots) for s in range(steps)]
    return torch.stack(out), state


@pytest.mark.parametrize("prefixes", [[7], [9, 4, 6]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_match_transformers_and_the_modules(tiny, with_mtp, prefixes, dtype, monkeypatch):
    """Decode steps of one sequence (a MoE layer runs the token's experts in turn) and of three (grouped by expert)
    through the plan: transformers' logits (float32 weights), and the modules' bit for bit, caches included."""
    path, _ = with_mtp
    model = QwenModel.from_checkpoint(open_checkpoint(path), weight_dtype=dtype, kv_dtype=torch.float32)
    logits, state = decode_run(model, prefixes, 3)
    assert any(key[0] == 0 and plan is not None for key, plan in model.__dict__["_decode_plans"].items())
    if dtype == torch.float32:
        for n, p in enumerate(prefixes):
            assert rel_err(logits[:, n], reference_logits(tiny, IDS[:p + 3])[p:]) < 1e-4

    monkeypatch.setattr(QwenModel, "decode_step", HybridModel.decode_step)
    modules, by_modules = decode_run(model, prefixes, 3)
    assert torch.equal(logits, modules)
    for ours, theirs in ((state.conv, by_modules.conv), (state.ssm, by_modules.ssm), (state.k, by_modules.k),
                         (state.v, by_modules.v)):
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_greedy_step_in_one_call_is_the_stepwise_path(arch, aligned, tmp_path):
    """mtp_greedy_step (drafts, verify, acceptance, rollback in one C++ call) against the same step through the
    Python path (models/mtp.draft, a forward pass keeping snapshots, engine accept, HybridState.rollback): the same
    drafts, tokens and every cache and length, bit for bit, over steps where drafts are refused (random weights)
    and where all of them are kept (the aligned model of tests/engine/test_mtp_spec.py), two sequences drafting 3
    and 2, dense and MoE MTP layers (qwen35moe's)."""
    from deltaserve import convert
    from deltaserve.engine.sampling import SamplingParams
    from deltaserve.engine.speculative import accept
    from tests.engine.test_mtp_spec import _aligned

    path = tmp_path / "m.gguf"
    made = convert.make_model(arch, "tiny", "f32", path, seed=5, mtp=True)
    if aligned:
        params = QwenModel.from_checkpoint(open_checkpoint(path)).state_dict()
        convert.write_gguf(path, made.config, _aligned(params), made.tokenizer, "f32")
    model = QwenModel.from_checkpoint(open_checkpoint(path))
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    slots, ks, greedy = torch.tensor([1, 0]), [3, 2], SamplingParams(temperature=0)
    states = [model.new_state(2, 64, mtp=True) for _ in range(2)]
    for state in states:
        model(ids[None, :11], state, [1])
        model(ids[None, 11:18], state, [0])
    pending = [int(ids[11]), int(ids[18])]
    kept = 0
    for _ in range(6):
        out = model.mtp_greedy_step(states[0], slots, torch.tensor(pending), ks)
        assert out is not None  # the plans apply
        drafts, accepted, following = (t.tolist() for t in out)

        state = states[1]
        start = state.lengths[slots].tolist()
        steps = draft(model, state, slots, torch.tensor(pending), ks)
        T = 1 + max(ks)
        rows = [[p, *d] + [d[-1]] * (T - 1 - len(d)) for p, d in zip(pending, steps)]
        logits = model(torch.tensor(rows), state, slots, logits="all", snapshots=T)
        for n, slot in enumerate(slots.tolist()):
            tokens = accept(logits[n], steps[n], greedy, None)
            state.rollback(slot, start[n] + len(tokens))
            assert drafts[n][:ks[n]] == steps[n] and [*drafts[n][:accepted[n]], following[n]] == tokens
            kept += accepted[n] == ks[n]
        for ours, theirs in zip(states[0].tensors(), states[1].tensors()):
            assert torch.equal(ours, theirs)
        assert torch.equal(states[0].lengths, states[1].lengths)
        pending = following
    assert (kept > 0) == aligned  # the aligned model's drafts are all kept at some steps; random ones never


@pytest.mark.parametrize("path", ["plan", "modules"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_a_verify_pass_gives_the_bits_of_decode_steps(arch, path, tmp_path, monkeypatch):
    """The logits of a pass over 5 tokens keeping snapshots (speculative verify) are those of 5 decode steps, bit
    for bit, on both paths: its attention, conv and delta rule run token by token as a step does, and the gates
    a row at a time (16 value heads: the ATen ops had vectorised 80 gates of a pass but not 16 of a step). So
    greedy speculative decoding keeps plain decoding's tokens even where two logits nearly tie."""
    from deltaserve import convert

    file = tmp_path / "m.gguf"
    convert.make_model(arch, "tiny", "f16", file, seed=4, changes={"linear_v_heads": 16, "linear_k_heads": 4})
    model = load_model(open_checkpoint(file))  # float16 weights as stored: our GEMVs, whose rows are batch-invariant
    if path == "modules":
        monkeypatch.setattr(QwenModel, "decode_step", HybridModel.decode_step)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(8))
    stepped, verified = model.new_state(3, 40), model.new_state(3, 40)
    for state in (stepped, verified):
        model(ids[:, :21], state, [2, 0])
    steps = torch.stack([model(ids[:, t:t + 1], stepped, [2, 0]) for t in range(21, 26)], dim=1)
    assert torch.equal(model(ids[:, 21:26], verified, [2, 0], logits="all", snapshots=5), steps)
    assert all(torch.equal(a, b) for a, b in zip(stepped.tensors(), verified.tensors()))


def test_the_one_call_step_refuses_what_would_write_outside_the_caches(tmp_path):
    """A slot out of range, named twice, without room for the pass, or a token outside the vocabulary: one clear
    error before anything is written."""
    from deltaserve import convert

    file = tmp_path / "m.gguf"
    convert.make_model("qwen35", "tiny", "f16", file, seed=5, mtp=True)
    model = load_model(open_checkpoint(file))
    state = model.new_state(2, 12, mtp=True)
    model(torch.tensor([[1, 2, 3]]), state, [0])
    model(torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11, 12]]), state, [1])  # 9 of 12: room for 3 more
    before = [t.clone() for t in state.tensors()]
    for slots, ids, ks, message in (([2], [5], [2], "slots \\[2\\] outside"), ([0, 0], [5, 6], [2, 2], "twice"),
                                    ([1], [5], [3], "cannot take 4 tokens"),
                                    ([0], [model.config.vocab_size], [2], "outside the vocabulary")):
        with pytest.raises((RuntimeError, DeltaserveError), match=message):
            model.mtp_greedy_step(state, torch.tensor(slots), torch.tensor(ids), ks)
        assert all(torch.equal(a, b) for a, b in zip(state.tensors(), before))
    assert model.mtp_greedy_step(state, torch.tensor([1]), torch.tensor([5]), [2]) is not None  # 3 tokens fit
