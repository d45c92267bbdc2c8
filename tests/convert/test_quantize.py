"""make_model(..., quantize=TYPE) / `deltaserve make-model --quantize TYPE`: llama.cpp's quantiser on the file we
write, checked with gguf-py's reader and dequantisers against the unquantised file of the same seed."""

import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import quants as gguf_quants

from deltaserve import cli
from deltaserve.convert import QUANTIZE_TYPES, make_model, tensor_types
from deltaserve.errors import DeltaserveError


def tensors(path) -> dict:
    """name -> (type, float32 values) of every tensor of a GGUF file, by gguf-py."""
    return {t.name: (t.tensor_type, gguf_quants.dequantize(t.data, t.tensor_type).reshape(-1))
            for t in GGUFReader(path).tensors}


# a type's relative RMS error on these weights, with a margin: what its bits per weight allow
@pytest.mark.parametrize("qtype, types, file_type, rms", [
    ("Q4_K_M", {Q.Q4_K, Q.Q6_K}, 15, 0.12),
    ("IQ4_XS", {Q.IQ4_XS, Q.Q6_K}, 30, 0.12),  # the tied embedding in Q6_K
    ("Q6_K", {Q.Q6_K}, 18, 0.03),
    ("Q8_0", {Q.Q8_0}, 7, 0.01),
])
def test_quantised_file_holds_the_same_weights(qtype, types, file_type, rms, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantises")
    source = make_model("qwen35", "tiny256", "f32", tmp_path / "f32.gguf", seed=2)
    made = make_model("qwen35", "tiny256", "f32", tmp_path / f"{qtype}.gguf", seed=2, quantize=qtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f32.gguf", f"{qtype}.gguf"])  # no leftovers
    assert GGUFReader(made.gguf_path).fields["general.file_type"].contents() == file_type
    ours, reference = tensors(made.gguf_path), tensors(source.gguf_path)
    assert ours.keys() == reference.keys()
    quantised = {name for name, (t, _) in ours.items() if t != Q.F32}
    assert {ours[n][0] for n in quantised} <= types and {ours[n][0] for n in quantised} & types
    assert all(reference[n][0] == Q.F32 for n in set(ours) - quantised)  # norms etc. stay F32 ...
    assert all(np.array_equal(ours[n][1], reference[n][1]) for n in set(ours) - quantised)  # ... unchanged
    for n in quantised:
        err, x = ours[n][1] - reference[n][1], reference[n][1]
        assert np.sqrt(np.mean(err ** 2) / np.mean(x ** 2)) < rms, n


def test_without_llama_cpp_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(DeltaserveError, match="llama-cpp-python"):
        make_model("qwen35", "tiny", "f32", tmp_path / "q.gguf", quantize="Q4_K_M")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype, qtype", [("f32", "Q3_K_S"), ("q8_0", "Q4_K_M")])
def test_unknown_type_or_quantised_source_is_refused(dtype, qtype, tmp_path):
    with pytest.raises(DeltaserveError, match="quantize must be one of"):
        make_model("qwen35", "tiny", dtype, tmp_path / "q.gguf", quantize=qtype)
    assert set(QUANTIZE_TYPES) >= {"Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q8_0", "BF16"}


def test_cli_quantises_and_says_what_came_out(tmp_path, capsys):
    """The tiny preset's 96-wide rows do not split into 256-weight blocks: llama.cpp falls back to other
    types, and the CLI says which."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantises")
    out = tmp_path / "q.gguf"
    try:
        cli.main(["make-model", "--arch", "qwen35", "--dtype", "f32", "--quantize", "Q4_K_M", str(out)])
    except SystemExit as done:
        assert not done.code
    counts = tensor_types(out)
    assert "Q4_K" not in counts and counts.keys() & {"Q5_0", "Q8_0"}
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("Q4_K_M as llama.cpp made it: ") and all(f"{n} {t}" in line for t, n in counts.items())
