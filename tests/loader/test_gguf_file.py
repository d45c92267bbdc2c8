"""GGUFCheckpoint on small files written by gguf-py's GGUFWriter, checked with gguf-py's reader."""

import time

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFWriter
from gguf import quants as ref

from deltaserve.errors import ModelLoadError
from deltaserve.loader import GGUFCheckpoint, open_checkpoint
from deltaserve.strings import StringArray

METADATA = {
    "general.name": "tiny héllo ✓",
    "tiny.block_count": 3,
    "tiny.rope.freq_base": 10000.5,
    "tiny.use_thing": True,
    "tiny.rope.dimension_sections": [11, 11, 10, 0],
    "tiny.scores": [0.25, -1.5, 3.0],
    "tokenizer.ggml.tokens": ["<s>", "hello", " wörld", ""],
}


def k_blocks(qtype: Q, rows: int, row_blocks: int, rng) -> np.ndarray:
    """[rows, row_blocks * type_size] random K-quant bytes with finite float16 d (and dmin)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * row_blocks, type_size), dtype=np.uint8)
    for off in {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]:
        raw[:, off:off + 2] = rng.uniform(-1, 1, (rows * row_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def make_tensors(rng) -> dict[str, tuple[np.ndarray, Q | None, tuple[int, ...]]]:
    """name -> (array to write, raw_dtype, torch-order shape the reader must report)."""
    x64 = rng.standard_normal((3, 64)).astype(np.float32)
    x96 = rng.standard_normal((5, 96)).astype(np.float32)
    return {
        "norm.weight": (rng.standard_normal(7).astype(np.float32), None, (7,)),
        "f32.weight": (rng.standard_normal((3, 5)).astype(np.float32), None, (3, 5)),
        "f32_3d.weight": (rng.standard_normal((2, 3, 4)).astype(np.float32), None, (2, 3, 4)),
        "f16.weight": (rng.standard_normal((5, 7)).astype(np.float16), None, (5, 7)),
        "bf16.weight": (ref.quantize(rng.standard_normal((3, 9)).astype(np.float32), Q.BF16), Q.BF16, (3, 9)),
        "q8_0.weight": (ref.quantize(x64, Q.Q8_0), Q.Q8_0, (3, 64)),
        "q4_0.weight": (ref.quantize(x96, Q.Q4_0), Q.Q4_0, (5, 96)),
        "q5_1.weight": (ref.quantize(x96, Q.Q5_1), Q.Q5_1, (5, 96)),
        "q4_k.weight": (k_blocks(Q.Q4_K, 3, 2, rng), Q.Q4_K, (3, 512)),
        "q5_k.weight": (k_blocks(Q.Q5_K, 1, 1, rng), Q.Q5_K, (1, 256)),
        "q6_k.weight": (k_blocks(Q.Q6_K, 5, 1, rng), Q.Q6_K, (5, 256)),
    }


TENSOR_NAMES = list(make_tensors(np.random.default_rng(0)))


def write_gguf(path, tensors, extra_raw=None):
    w = GGUFWriter(str(path), "tiny")
    w.add_string("general.name", METADATA["general.name"])
    w.add_uint32("tiny.block_count", METADATA["tiny.block_count"])
    w.add_float32("tiny.rope.freq_base", METADATA["tiny.rope.freq_base"])
    w.add_bool("tiny.use_thing", METADATA["tiny.use_thing"])
    w.add_uint64("tiny.big", 2**40 + 3)
    w.add_float64("tiny.eps", 1e-6)
    w.add_int32("tiny.negative", -5)
    for key in ("tiny.rope.dimension_sections", "tiny.scores", "tokenizer.ggml.tokens"):
        w.add_array(key, METADATA[key])
    for name, (array, raw_dtype, _) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tensors = make_tensors(np.random.default_rng(0))
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors)
    return path, tensors


@pytest.fixture(scope="module")
def ckpt(written):
    return GGUFCheckpoint(written[0])


@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_tensor_matches_numpy_reference(written, ckpt, name):
    path, tensors = written
    stored = {t.name: t for t in GGUFReader(path).tensors}[name]
    expected = ref.dequantize(stored.data, stored.tensor_type).astype(np.float32)
    _, raw_dtype, shape = tensors[name]

    assert ckpt.shape(name) == shape
    assert ckpt.qtype(name) == (raw_dtype or stored.tensor_type)
    ours = ckpt.load(name, shape=shape)
    assert ours.dtype == torch.float32 and ours.is_contiguous() and tuple(ours.shape) == shape
    torch.testing.assert_close(ours, torch.from_numpy(expected.reshape(shape)), rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in TENSOR_NAMES if len(make_tensors(np.random.default_rng(0))[n][2]) == 2])
def test_rows_read_a_block_at_a_time(written, ckpt, name):
    """load_rows (embeddings read in blocks, never whole in float32) gives gguf-py's values of those rows."""
    stored = {t.name: t for t in GGUFReader(written[0]).tensors}[name]
    expected = torch.from_numpy(ref.dequantize(stored.data, stored.tensor_type).astype(np.float32))
    expected = expected.reshape(ckpt.shape(name))
    R = expected.shape[0]
    for start, end in [(0, R), (1, R), (0, 1), (R - 1, R + 5)]:
        torch.testing.assert_close(ckpt.load_rows(name, start, end), expected[start:end], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [n for n in TENSOR_NAMES if len(make_tensors(np.random.default_rng(0))[n][2]) == 2])
def test_rows_written_into_a_tensor(written, ckpt, name, dtype):
    """rows_into (a weight's rows straight into its storage) writes gguf-py's values of those rows, rounded to the
    storage's dtype as a float32 copy would be; a tensor the file stores in that dtype keeps its exact bits."""
    stored = {t.name: t for t in GGUFReader(written[0]).tensors}[name]
    expected = torch.from_numpy(ref.dequantize(stored.data, stored.tensor_type).astype(np.float32))
    expected = expected.reshape(ckpt.shape(name))
    R, C = expected.shape
    for start, end in [(0, R), (1, R), (R - 1, R)]:
        out = torch.full((end - start, C), 7.0, dtype=dtype)
        ckpt.rows_into(name, start, end, out)
        assert torch.equal(out, expected[start:end].to(dtype))
    kept = {Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}.get(stored.tensor_type)
    assert ckpt.float_dtype(name) == kept
    if kept is not None:
        native = torch.from_numpy(np.array(stored.data)).view(kept)
        out = torch.empty(R, C, dtype=native.dtype)
        ckpt.rows_into(name, 0, R, out)
        assert torch.equal(out.view(-1), native.reshape(-1))


def test_values_survive_the_round_trip(written, ckpt):
    _, tensors = written
    torch.testing.assert_close(ckpt.load("f32_3d.weight"), torch.from_numpy(tensors["f32_3d.weight"][0]))
    # Q8_0 of standard normal data (make_tensors' first draw from seed 0): error within half a
    # quantisation step (amax / 254), plus the float16 rounding of the scale
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    assert (ckpt.load("q8_0.weight") - torch.from_numpy(x)).abs().max() < np.abs(x).max() / 254 * 1.1


def test_dtype_and_raw_view(written, ckpt):
    as_bf16 = ckpt.load("q4_k.weight", dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(as_bf16, ckpt.load("q4_k.weight").to(torch.bfloat16), rtol=0, atol=0)

    qtype, raw, shape = ckpt.raw("q6_k.weight")
    assert qtype == Q.Q6_K and raw.dtype == torch.uint8 and shape == (5, 256)
    stored = {t.name: t for t in GGUFReader(written[0]).tensors}["q6_k.weight"]
    file_bytes = written[0].read_bytes()[stored.data_offset:stored.data_offset + stored.n_bytes]
    assert raw.numpy().tobytes() == file_bytes
    assert ckpt.raw("q6_k.weight")[1].data_ptr() == raw.data_ptr()  # a view of the mmap, no copy


def test_metadata_round_trip(ckpt):
    assert ckpt.arch == "tiny"
    for key, value in METADATA.items():
        got = ckpt.metadata[key]
        if isinstance(value, float) or (isinstance(value, list) and isinstance(value[0], float)):
            assert got == pytest.approx(value, rel=1e-7)  # stored as float32
        elif isinstance(value, list) and isinstance(value[0], str):
            assert isinstance(got, StringArray) and got == value and list(got) == value
            assert [got[i] for i in range(-len(value), len(value))] == value + value and got[1:3] == value[1:3]
        else:
            assert got == value and type(got) is type(value)
    assert ckpt.get("tiny.big") == 2**40 + 3
    assert ckpt.get("tiny.eps") == 1e-6  # float64 stays exact
    assert ckpt.get("tiny.negative") == -5
    assert not any(k.startswith("GGUF.") for k in ckpt.metadata)


def test_metadata_matches_gguf_reader(written, ckpt):
    fields = GGUFReader(written[0]).fields
    expected = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert ckpt.metadata == expected
    assert list(ckpt.metadata) == list(expected)  # file order kept


def test_a_string_array_item_that_is_not_utf8(written, tmp_path):
    data = written[0].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace(" wörld".encode(), b" w\xff\xferld", 1))  # the same length: only the text breaks
    with pytest.raises(ModelLoadError, match=r"metadata 'tokenizer.ggml.tokens' is not valid UTF-8"):
        GGUFCheckpoint(bad)


def test_get_missing_key(ckpt):
    assert ckpt.get("tiny.nope", 42) == 42
    assert ckpt.get("tiny.nope", None) is None
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf.*'tiny\.nope' is missing"):
        ckpt.get("tiny.nope")


def test_missing_tensor(ckpt):
    assert ckpt.has("q8_0.weight") and not ckpt.has("nope.weight")
    assert ckpt.names() == TENSOR_NAMES
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: tensor 'nope\.weight': .*not found"):
        ckpt.load("nope.weight")
    with pytest.raises(ModelLoadError, match="nope.weight"):
        ckpt.shape("nope.weight")


def test_shape_mismatch_names_both_shapes(ckpt):
    with pytest.raises(ModelLoadError, match=r"'q8_0\.weight'.*expected shape \(64, 3\), found \(3, 64\)"):
        ckpt.load("q8_0.weight", shape=(64, 3))


def test_progress_yields_names_in_order(ckpt, monkeypatch):
    monkeypatch.setenv("DELTASERVE_NO_PROGRESS", "1")
    names = ckpt.names()[::-1]
    assert list(ckpt.progress(names)) == names
    with pytest.raises(ModelLoadError, match="nope"):
        ckpt.progress(["q8_0.weight", "nope"])


def test_unsupported_tensor_type_is_named(tmp_path):
    raw = np.random.default_rng(3).integers(0, 256, (2, 66), dtype=np.uint8)  # IQ2_XXS: 66 B/block
    path = write_gguf(tmp_path / "iq2.gguf", {"iq2.weight": (raw, Q.IQ2_XXS, (2, 256))})
    ckpt = GGUFCheckpoint(path)
    assert ckpt.shape("iq2.weight") == (2, 256)
    with pytest.raises(ModelLoadError, match=r"iq2\.gguf: tensor 'iq2\.weight': unsupported .*IQ2_XXS"):
        ckpt.load("iq2.weight")


def cut_points(path) -> dict[str, int]:
    """Byte offsets inside each section of the file, found with gguf-py's reader."""
    reader = GGUFReader(path)
    last = reader.tensors[-1]
    return {
        "empty": 0,
        "magic": 3,
        "header": 13,
        "kv_key": reader.fields["tiny.block_count"].offset + 5,
        "kv_string_array": reader.fields["tokenizer.ggml.tokens"].offset + 60,
        "tensor_info": reader.tensors[2].field.offset + 11,
        "data_start": reader.data_offset,
        "first_tensor": reader.tensors[0].data_offset + 5,
        "last_byte": last.data_offset + last.n_bytes - 1,
    }


@pytest.mark.parametrize("where", ["empty", "magic", "header", "kv_key", "kv_string_array",
                                   "tensor_info", "data_start", "first_tensor", "last_byte"])
def test_truncated_file(written, tmp_path, where):
    full = written[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:cut_points(written[0])[where]])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        GGUFCheckpoint(cut)


def test_data_past_the_end_names_the_tensor(written, tmp_path):
    reader = GGUFReader(written[0])
    last = reader.tensors[-1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(written[0].read_bytes()[:last.data_offset + 7])
    with pytest.raises(ModelLoadError, match=rf"tensor '{last.name}': data .* runs past the end"):
        GGUFCheckpoint(cut)


def test_bad_magic(written, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + written[0].read_bytes()[4:])
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: not a GGUF file"):
        GGUFCheckpoint(bad)
    text = tmp_path / "notes.gguf"
    text.write_text("just some text, long enough to hold a header\n")
    with pytest.raises(ModelLoadError, match=r"notes\.gguf: not a GGUF file"):
        open_checkpoint(text)


@pytest.mark.parametrize("field", ["kv_count", "tokens_count"])
def test_corrupt_counts_fail_fast(written, tmp_path, field):
    data = bytearray(written[0].read_bytes())
    reader = GGUFReader(written[0])
    if field == "kv_count":
        offset = 16  # magic, version, tensor count, kv count
    else:  # key length, key, value type, item type, then the item count
        offset = reader.fields["tokenizer.ggml.tokens"].offset + 8 + len("tokenizer.ggml.tokens") + 8
    data[offset:offset + 8] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "counts.gguf"
    bad.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"counts\.gguf: file is truncated or corrupt"):
        GGUFCheckpoint(bad)
    assert time.monotonic() - start < 5


def test_missing_file_and_open_checkpoint(written, tmp_path):
    with pytest.raises(ModelLoadError, match=r"absent\.gguf: file not found"):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match=r"absent\.gguf"):
        open_checkpoint(tmp_path / "absent.gguf")
    assert isinstance(open_checkpoint(written[0]), GGUFCheckpoint)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"weights\.bin: not a checkpoint"):
        open_checkpoint(other)


def test_random_header_corruption_gives_model_load_errors(written, tmp_path):
    # Flipped bytes anywhere before the tensor data: the file opens (and its tensors load or fail
    # cleanly) or it is refused with a ModelLoadError, never another exception and never slowly.
    full = written[0].read_bytes()
    header_end = GGUFReader(written[0]).data_offset
    rng = np.random.default_rng(7)
    bad = tmp_path / "fuzz.gguf"
    refused = 0
    start = time.monotonic()
    for _ in range(300):
        data = bytearray(full)
        for pos in rng.integers(0, header_end, size=rng.integers(1, 4)):
            data[pos] = rng.integers(0, 256)
        bad.write_bytes(bytes(data))
        try:
            ckpt = GGUFCheckpoint(bad)
            for name in ckpt.names():
                try:
                    ckpt.load(name)
                except ModelLoadError:
                    pass
        except ModelLoadError as e:
            assert "fuzz.gguf" in str(e)
            refused += 1
    assert refused > 100
    assert time.monotonic() - start < 30
