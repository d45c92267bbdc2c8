"""The tensor table of a GGUF file against its data: every corruption of a type, a shape or an offset that
changes where bytes lie is refused when the file is opened, naming the tensor, instead of loading other bytes
as weights. Files come from make_model; their headers are rewritten with tests/loader/gguf_edit.py."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.errors import ModelLoadError
from deltaserve.loader import GGUFCheckpoint, open_checkpoint
from deltaserve.models import load_model

from . import gguf_edit
from .gguf_edit import V, Value

MATRIX = "blk.0.attn_qkv.weight"  # an F16 [384, 96] in the middle of the file
SMALL = "blk.0.ssm_a"  # an F32 [6]: 24 bytes in a 32-byte slot


@pytest.fixture(scope="module")
def image(tiny_f16):
    return gguf_edit.read(tiny_f16.gguf_path)


def refused(image, tmp_path, match: str) -> ModelLoadError:
    path = gguf_edit.write(image, tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match=match) as error:
        open_checkpoint(path)
    assert "bad.gguf" in str(error.value)
    return error.value


def test_the_untouched_image_loads_the_same_weights(image, tiny_f16, tmp_path):
    path = gguf_edit.write(image, tmp_path / "same.gguf")
    assert path.read_bytes() == tiny_f16.gguf_path.read_bytes()
    ours, original = GGUFCheckpoint(path), GGUFCheckpoint(tiny_f16.gguf_path)
    assert torch.equal(ours.load(MATRIX), original.load(MATRIX))


@pytest.mark.parametrize("shift", range(1, 17))
def test_an_offset_shifted_by_a_few_bytes(image, tmp_path, shift):
    bad = image.copy()
    bad.tensor(MATRIX).offset += shift
    error = refused(bad, tmp_path, rf"tensor '{MATRIX}': data offset \d+ is not a multiple of general.alignment \(32\)")
    assert error.tensor == MATRIX


@pytest.mark.parametrize("shift", [-32, 32, 4096])
def test_an_offset_moved_by_whole_alignment_units(image, tmp_path, shift):
    bad = image.copy()
    bad.tensor(MATRIX).offset += shift
    refused(bad, tmp_path, rf"tensor '{MATRIX}': data at offset \d+ .* tensor 'blk.0.post_attention_norm.weight' "
                           r"before it \(F32, shape \(96,\), 384 bytes .* is corrupt")


def test_two_tensors_sharing_bytes(image, tmp_path):
    bad = image.copy()
    names = [t.name for t in bad.tensors]
    after = bad.tensors[names.index(MATRIX) + 1]
    after.offset = bad.tensor(MATRIX).offset
    refused(bad, tmp_path, rf"tensor '{after.name}': data at offset .* tensor '{MATRIX}' before it")


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0, Q.Q8_0, Q.Q5_1])
def test_a_matrix_type_changed(image, tmp_path, qtype):
    """A type of another byte size moves where the next tensor's data would start."""
    bad = image.copy()
    bad.tensor(MATRIX).ttype = int(qtype)
    refused(bad, tmp_path, rf"data at offset .* tensor '{MATRIX}' before it \({qtype.name}, shape \(384, 96\)")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_a_matrix_type_changed_to_one_its_rows_do_not_fit(image, tmp_path, qtype):
    bad = image.copy()
    bad.tensor(MATRIX).ttype = int(qtype)
    refused(bad, tmp_path, rf"tensor '{MATRIX}': corrupt tensor info: {qtype.name} rows must hold a multiple of 256")


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_a_small_tensor_type_changed_within_its_padding(image, tmp_path, qtype):
    """F32 [6] -> 16-bit keeps the 32-byte slot: the old data shows where padding (zeros) should be."""
    bad = image.copy()
    bad.tensor(SMALL).ttype = int(qtype)
    refused(bad, tmp_path, rf"tensor '{SMALL}': the 20 padding bytes after its data .* are not zero: its type "
                           rf"\({qtype.name}\)")


def test_the_last_tensor_type_changed(image, tmp_path):
    bad = image.copy()
    last = bad.tensors[-1]
    last.ttype = int(Q.F16)  # F32 [96] -> F16: 192 bytes of data left over at the end
    refused(bad, tmp_path, rf"192 bytes follow the data of the last tensor \(tensor '{last.name}'")


def test_a_shape_changed(image, tmp_path):
    bad = image.copy()
    bad.tensor(MATRIX).ne = [96, 385]
    refused(bad, tmp_path, rf"before it \(F16, shape \(385, 96\)")


def test_unknown_tensor_type(image, tmp_path):
    bad = image.copy()
    bad.tensor(MATRIX).ttype = 99
    refused(bad, tmp_path, rf"tensor '{MATRIX}': corrupt tensor info: 99 is not a valid GGMLQuantizationType")


def test_trailing_bytes(image, tmp_path):
    bad = image.copy()
    bad.data += b"\0" * 64
    refused(bad, tmp_path, "64 bytes follow the data of the last tensor")


@pytest.mark.parametrize("alignment", [1, 64, 4096])
def test_another_alignment(image, tmp_path, alignment):
    bad = image.copy()
    bad.metadata["general.alignment"] = Value(V.UINT32, alignment)
    refused(bad, tmp_path, "data at offset|not a multiple|runs past the end|bytes follow")


def test_an_alignment_the_layout_also_satisfies_reads_the_same_bytes(image, tiny_f16, tmp_path):
    """Every tensor of this file takes a multiple of 32 bytes but the F32 [6] ones (24 bytes, padded to 32
    either way): with its header padded to 16 the file is a consistent GGUF of alignment 16, not a corrupt one."""
    other = image.copy()
    other.metadata["general.alignment"] = Value(V.UINT32, 16)
    ours, original = GGUFCheckpoint(gguf_edit.write(other, tmp_path / "align16.gguf")), GGUFCheckpoint(tiny_f16.gguf_path)
    assert all(torch.equal(ours.load(t.name), original.load(t.name)) for t in image.tensors)


def test_a_file_that_ends_at_the_last_tensor_data_is_read(image, tmp_path):
    """A writer that does not pad after the last tensor: no bytes are missing, and none are read as weights."""
    cut = image.copy()
    last = cut.tensors[-1]
    cut.data = cut.data[:last.offset + 4 * last.ne[0]]
    path = gguf_edit.write(cut, tmp_path / "unpadded.gguf")
    assert GGUFCheckpoint(path).load(last.name).shape == (last.ne[0],)


def test_corrupt_files_never_reach_the_model(image, tmp_path):
    """The loading path as a user runs it: open_checkpoint then load_model. A corrupt table stops at the first."""
    for change in (lambda img: setattr(img.tensor(MATRIX), "offset", img.tensor(MATRIX).offset + 2),
                   lambda img: setattr(img.tensor(MATRIX), "ttype", int(Q.Q8_0))):
        bad = image.copy()
        change(bad)
        path = gguf_edit.write(bad, tmp_path / "corrupt.gguf")
        with pytest.raises(ModelLoadError, match=MATRIX):
            load_model(open_checkpoint(path))
