"""Tensor parallel over quantised files: shares of packed GGML blocks against gguf-py's dequantised values,
the refusal of a column share that parts a block, and whole quantised models in 2 shards against one
process on the same file (tests/dist/ranks.check_quantised)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as Q

from deltaserve.convert import make_model
from deltaserve.dist.tensor import TensorPart
from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.models import load_model, packed
from deltaserve.models.layers import dequantize, linear, part
from tests.models.test_packed_weights import assert_matmul, packed_matrix

from . import ranks
from tests.processes import free_port


@pytest.fixture
def float_activations(monkeypatch):
    """Products to float32 accuracy: K-quant matrices otherwise round activations to int8 (test_int8_dot.py)."""
    monkeypatch.setattr(packed, "INT8_ACTIVATIONS", False)


def test_row_shares_are_the_files_rows_then_zero_rows(float_activations):
    """A fused projection's rank share (two row ranges across a change of type) plus a padded vocabulary."""
    w, ref = packed_matrix([(Q.Q6_K, 5), (Q.Q4_K, 9), (Q.IQ4_XS, 4)], 512, seed=1)
    got = packed.take_rows(w, [(1, 3), (4, 11), (16, 18)], pad=3)
    want = torch.cat([ref[1:3], ref[4:11], ref[16:18], torch.zeros(3, 512, dtype=torch.float64)])
    assert got.packing.segments == ((Q.Q6_K, 3), (Q.Q4_K, 6), (Q.IQ4_XS, 5))  # rows 1-2, 4 | 5-10 | 16-17, pad
    assert torch.equal(dequantize(got, torch.float32).double(), want)
    x = torch.randn(5, 512)
    assert_matmul(linear(x, got), x, want)


def test_column_shares_follow_held_order_through_the_files_blocks(float_activations):
    """Qwen3.5's tiled value heads: 4 heads of 64 columns held in grouped order, stored tiled (held head j at
    file head 2 * (j % 2) + j // 2); a share of held heads 0-1 is file heads 0 and 2, whole Q4_0 blocks."""
    heads = torch.tensor([0, 2, 1, 3])  # file head -> held head
    x_index = (heads[:, None] * 64 + torch.arange(64)).reshape(-1)
    w, ref = packed_matrix([(Q.Q4_0, 7), (Q.IQ4_NL, 6)], 256, seed=2, x_index=x_index)
    for start, end in ((0, 128), (128, 256)):
        got = packed.take_columns(w, start, end, "ssm_out")
        assert torch.equal(dequantize(got, torch.float32).double(), ref[:, start:end])
        x = torch.randn(3, end - start)
        assert_matmul(linear(x, got), x, ref[:, start:end])


def test_a_column_share_that_parts_a_block_is_refused_by_name():
    w, _ = packed_matrix([(Q.Q4_K, 3)], 512, seed=3)
    with pytest.raises(DeltaserveError, match=r"blk\.7\.ffn_down\.weight.*columns 128:256 of 512 .*Q4_K block "
                                              r"boundaries \(256 values"):
        packed.take_columns(w, 128, 256, "blk.7.ffn_down.weight")


def test_expert_shares_are_whole_matrices(float_activations):
    K, n = 256, 5
    mats = [packed_matrix([(Q.Q4_K, 20), (Q.Q6_K, 12)], K, seed=e) for e in range(n)]
    stacked = packed.parameter(torch.stack([w.data for w, _ in mats]),
                               packed.Packing(mats[0][0].packing.segments, (n, 32, K)))
    held = packed.take_matrices(stacked, 2, 5)
    assert held.packing.shape == (3, 32, K)
    x = torch.randn(4, K)
    for e in range(3):
        assert_matmul(linear(x, part(held, e)), x, mats[2 + e][1])


def test_q8_0_file_refuses_a_column_share_off_its_blocks(tmp_path):
    """tiny's MLP is 160 wide: 80 columns a rank are not whole blocks of 32 (f32 files split anywhere)."""
    path = make_model("qwen35", "tiny", "q8_0", tmp_path / "q8.gguf", seed=3,
                      changes=dict(linear_k_heads=2, linear_v_heads=4, linear_v_dim=64)).gguf_path
    with pytest.raises(DeltaserveError, match=r"layers\.0\.ffn\.down\.weight \(blk\.0\.ffn_down\.weight Q8_0\): "
                                              r"--tp 2 gives each rank 80 of its 160 columns, not whole blocks of 32"):
        load_model(open_checkpoint(path), part=TensorPart(0, 2))


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """(arch, preset, changes, qtype) -> that file, made once; llama.cpp quantises all but Q8_0."""
    root, made = tmp_path_factory.mktemp("tp-quantised"), {}

    def get(arch: str, preset: str, changes: dict, qtype: str):
        key = (arch, preset, tuple(sorted(changes.items())), qtype)
        if key not in made:
            if qtype != "Q8_0":
                pytest.importorskip("llama_cpp", reason="llama-cpp-python quantises the K-quant test models")
            path = root / f"{len(made)}-{arch}-{qtype}.gguf"
            dtype, quantize = ("q8_0", None) if qtype == "Q8_0" else ("f32", qtype)
            made[key] = make_model(arch, preset, dtype, path, seed=3, changes=changes, quantize=quantize).gguf_path
        return made[key]
    return get


# column shares on whole blocks: 32 values for Q8_0 / Q4_0, 256 for K-quants (tiny256 with 4 key heads, so no
# tiling parts a share, and wider heads); qwen35's Q4_0 keeps tiled value heads (a share is 2 runs of 64)
Q8 = ("qwen35moe", "tiny", dict(linear_k_heads=2, linear_v_heads=4, linear_v_dim=64,
                                 shared_expert_intermediate_size=128), "Q8_0")
K4 = ("qwen35moe", "tiny256", dict(linear_k_heads=4, linear_v_heads=4, linear_v_dim=128, head_dim=128,
                                    shared_expert_intermediate_size=512), "Q4_K_M")
Q40 = ("qwen35", "tiny", dict(linear_k_heads=2, linear_v_heads=4, linear_v_dim=64, intermediate_size=192), "Q4_0")


BF16 = ("qwen35moe", "tiny", dict(linear_k_heads=2, linear_v_heads=4, linear_v_dim=64,
                                   shared_expert_intermediate_size=128), "BF16")


@pytest.mark.parametrize("spec, int8", [(Q8, False), (Q8, True), (K4, False), (K4, True), (Q40, False), (BF16, False),
                                        (BF16, True)],
                         ids=["Q8_0", "Q8_0-int8-activations", "Q4_K_M-float-activations", "Q4_K_M-int8-activations",
                              "Q4_0-tiled", "BF16-float-activations", "BF16-bf16-activations"])
def test_quantised_shards_match_one_process(spec, int8, quantised):
    mp.spawn(ranks.check_quantised, args=(str(quantised(*spec)), free_port(), int8), nprocs=2)


def test_k_quant_file_refuses_a_share_that_parts_its_blocks(quantised):
    """tiny256: 4 value heads of 64, so a rank's half of ssm_out's 256 columns is half a Q4_K block."""
    path = quantised("qwen35", "tiny256", {}, "Q4_K_M")
    with pytest.raises(DeltaserveError, match=r"layers\.0\.mixer\.out_proj\.weight \(blk\.0\.ssm_out\.weight Q\d_K\): "
                                              r"columns 0:128 of 256 do not fall on Q\d_K block boundaries \(256"):
        load_model(open_checkpoint(path), part=TensorPart(0, 2))


def test_shards_keep_the_files_blocks(quantised):
    """Every quantised tensor of the file is split between the ranks as its own bytes: together they hold the
    file's quantised bytes, plus the zero rows that pad the vocabulary's last share."""
    path = quantised(*K4)
    ckpt = open_checkpoint(path)
    file_bytes = sum(ckpt.nbytes(n) for n in ckpt.names() if ckpt.qtype(n) not in (Q.F32, Q.F16))
    V, E = ckpt.shape("token_embd.weight")
    pad = sum((-V % 2) * packed.row_bytes(ckpt.qtype(n), E) for n in ("token_embd.weight", "output.weight"))
    held = 0
    for rank in range(2):
        model = load_model(open_checkpoint(path), part=TensorPart(rank, 2))
        held += sum(w.nbytes for w in model.parameters() if packed.is_packed(w))
        assert packed.is_packed(model.layers[0].ffn.experts.down) and model.layers[0].ffn.experts.first == 2 * rank
    assert held == file_bytes + pad


def test_bf16_shares_stay_bfloat16(quantised):
    """A BF16 file's rank shares (rows, columns, experts, the padded vocabulary) keep its matrices in bfloat16."""
    path = quantised(*BF16)
    for rank in range(2):
        model = load_model(open_checkpoint(path), part=TensorPart(rank, 2))
        layer = model.layers[0]
        assert {w.dtype for w in (model.embed.weight, layer.mixer.in_proj.weight, layer.mixer.out_proj.weight,
                                  layer.ffn.experts.gate_up, layer.ffn.experts.down)} == {torch.bfloat16}
