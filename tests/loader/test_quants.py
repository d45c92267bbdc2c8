"""Our torch dequantisers against gguf-py's numpy ones (an independent implementation)."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as ref

from deltaserve.loader.quants import SUPPORTED_TYPES, dequantize, quantize_q8_0

# Byte offsets of the float16 scales inside each block: random bytes there could be inf/NaN.
F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0],
}
# Odd row counts and several blocks per row, so row/block layout mistakes show.
SHAPES = [(1, 1), (3, 1), (5, 3), (2, 3, 2)]  # last dim counted in blocks


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, type_size] random bytes with finite float16 scales of both signs."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        scale = rng.uniform(-2, 2, size=n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def tensor_shape(qtype: Q, blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    block, _ = GGML_QUANT_SIZES[qtype]
    return (*blocks_shape[:-1], blocks_shape[-1] * block)


@pytest.mark.parametrize("blocks_shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES - {Q.Q8_K}), ids=lambda t: t.name)
def test_matches_gguf_numpy_reference(qtype, blocks_shape):
    rng = np.random.default_rng(int(qtype) * 100 + len(blocks_shape))
    shape = tensor_shape(qtype, blocks_shape)
    # float types get 7 elements per row so nothing hides behind round numbers
    if GGML_QUANT_SIZES[qtype][0] == 1:
        shape = (*shape[:-1], 7 * shape[-1])
    n_blocks = int(np.prod(shape)) // GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, n_blocks, rng)
    byte_rows = raw.reshape(*shape[:-1], -1)

    expected = ref.dequantize(byte_rows, qtype).astype(np.float32)
    ours = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape)

    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    # float types carry random bit patterns, NaNs included
    torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=0, atol=0, equal_nan=True)


def test_block_shaped_input_and_unaligned_floats():
    rng = np.random.default_rng(0)
    raw = random_blocks(Q.Q6_K, 6, rng)
    expected = ref.dequantize(raw.reshape(3, -1), Q.Q6_K)
    ours = dequantize(torch.from_numpy(raw), Q.Q6_K, (3, 512))  # [6, 210] blocks
    torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=0, atol=0)

    q8 = random_blocks(Q.Q8_0, 3, rng)
    shifted = torch.zeros(q8.size + 1, dtype=torch.uint8)
    shifted[1:].copy_(torch.from_numpy(q8.reshape(-1)))  # starts at an odd byte
    expected = ref.dequantize(q8.reshape(1, -1), Q.Q8_0)
    torch.testing.assert_close(dequantize(shifted[1:], Q.Q8_0, (1, 96)), torch.from_numpy(expected),
                               rtol=0, atol=0)

    values = rng.standard_normal(5).astype(np.float32)
    storage = torch.zeros(21, dtype=torch.uint8)
    storage[1:].copy_(torch.from_numpy(values.view(np.uint8)))  # starts at an odd byte
    torch.testing.assert_close(dequantize(storage[1:], Q.F32, (5,)), torch.from_numpy(values))


def test_q8_k_hand_computed():
    # gguf-py has no Q8_K decoder: y = d (float32) * q (int8); bsums are not part of the value.
    rng = np.random.default_rng(1)
    d = rng.uniform(-1, 1, size=3).astype(np.float32)
    q = rng.integers(-128, 128, size=(3, 256), dtype=np.int8)
    bsums = rng.integers(0, 256, size=(3, 32), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(3, 4), q.view(np.uint8), bsums], axis=1)
    expected = (d.astype(np.float64)[:, None] * q).astype(np.float32)
    ours = dequantize(torch.from_numpy(raw.reshape(-1)), Q.Q8_K, (3, 256))
    torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=0, atol=0)


def test_q4_0_hand_computed():
    # One block: d = 0.5; byte j holds element j (low nibble) and element j + 16 (high nibble).
    qs = np.arange(16, dtype=np.uint8) | (np.uint8(15) - np.arange(16, dtype=np.uint8)) << 4
    raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])
    expected = 0.5 * (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8)
    ours = dequantize(torch.from_numpy(raw), Q.Q4_0, (32,))
    torch.testing.assert_close(ours, torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0, Q.I32], ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(ValueError, match=qtype.name):
        dequantize(torch.zeros(64, dtype=torch.uint8), qtype, (1, 256))


def test_mxfp4_from_gguf_quantiser_and_extreme_exponents():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 96)) * 10.0 ** rng.integers(-3, 3, (4, 1))).astype(np.float32)
    raw = ref.quantize(x, Q.MXFP4)
    ours = dequantize(torch.from_numpy(raw.reshape(-1)), Q.MXFP4, x.shape)
    torch.testing.assert_close(ours, torch.from_numpy(ref.dequantize(raw, Q.MXFP4)), rtol=0, atol=0)
    # exponents 0 and 1 decode to subnormal scales, 250 to 2^123
    blocks = random_blocks(Q.MXFP4, 5, rng)
    blocks[:, 0] = [0, 1, 2, 127, 250]
    ours = dequantize(torch.from_numpy(blocks.reshape(-1)), Q.MXFP4, (5, 32))
    torch.testing.assert_close(ours, torch.from_numpy(ref.dequantize(blocks, Q.MXFP4)), rtol=0, atol=0)


def test_unsupported_type_in_a_file_names_tensor_and_type(tmp_path):
    import gguf

    from deltaserve.errors import ModelLoadError
    from deltaserve.loader.gguf_file import GGUFCheckpoint

    writer = gguf.GGUFWriter(tmp_path / "iq2.gguf", "qwen35")
    _, type_size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((2, type_size), np.uint8), raw_dtype=Q.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS|IQ2_XXS.*blk\.0\.ffn_up\.weight"):
        GGUFCheckpoint(tmp_path / "iq2.gguf").load("blk.0.ffn_up.weight")


def test_wrong_sizes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (1, 33))
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (1, 64))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(16, dtype=torch.float32), Q.F32, (16,))


def q8_0_inputs():
    rng = np.random.default_rng(2)
    ties = np.zeros(32, np.float32)  # amax 127 -> d = 1: every x.5 is a tie
    ties[:9] = [127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5]
    return {
        "normal_5x96": rng.standard_normal((5, 96)).astype(np.float32),
        "wide_range_3x64": (rng.standard_normal((3, 64)) * 10.0 ** rng.integers(-4, 4, (3, 1))).astype(np.float32),
        "ties_and_zero_block": np.stack([ties, np.zeros(32, np.float32), -ties]),
    }


@pytest.mark.parametrize("name", list(q8_0_inputs()))
def test_quantize_q8_0_bit_exact(name):
    x = q8_0_inputs()[name]
    expected = ref.quantize(x, Q.Q8_0)
    ours = quantize_q8_0(torch.from_numpy(x))
    assert ours.dtype == torch.uint8
    np.testing.assert_array_equal(ours.numpy(), expected)
    # and it decodes to within half a step of the input, plus the float16 rounding of d
    back = dequantize(ours, Q.Q8_0, x.shape).numpy().reshape(-1, 32)
    step = np.abs(x.reshape(-1, 32)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(back - x.reshape(-1, 32)) <= step * (0.5 + 127 * 2.0**-11))
