"""bench/rounds.py: both engines decode in alternating rounds, each in its own worker process loaded at once."""

import subprocess
import sys

import pytest

from deltaserve.bench import rounds


def test_rates_and_ratios_by_hand():
    # deltaserve took 0.5 s and 0.4 s for its two rounds of 16 tokens, llama.cpp 1.0 s and 0.6 s
    out = rounds.summarize({"deltaserve": [0.5, 0.4], "llama.cpp": [1.0, 0.6]}, 16)
    assert out["decode_tok_s"]["deltaserve"] == pytest.approx(32 / 0.9)
    assert out["decode_tok_s"]["llama.cpp"] == pytest.approx(32 / 1.6)
    assert out["ratio"] == pytest.approx(1.6 / 0.9)
    assert out["round_ratios"] == pytest.approx([2.0, 1.5]) and out["round_ratio_median"] == pytest.approx(1.75)
    line = rounds.format_rounds(out, 2, 16)
    assert "35.6 vs 20.0 tok/s = 1.78x" in line and "median 1.75x, 1.50-2.00x" in line


def test_the_deltaserve_worker_answers_each_round_with_its_seconds(tiny_gguf):
    cmd = [sys.executable, "-m", "deltaserve.bench.rounds", str(tiny_gguf), "deltaserve", "2", "600", "float32"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for n in (3, 5):
            proc.stdin.write(f"{n}\n")
            proc.stdin.flush()
            assert 0 < float(proc.stdout.readline()) < 60
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def test_a_worker_that_cannot_start_is_named_with_its_error(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(RuntimeError, match="deltaserve rounds worker failed") as err:
        rounds.decode_rounds({"deltaserve": str(missing), "llama.cpp": str(missing)}, 1, 2, 2)
    assert "missing.gguf" in str(err.value)


def test_both_engines_decode_in_alternating_rounds(tiny_gguf):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")
    out = rounds.decode_rounds({"deltaserve": str(tiny_gguf), "llama.cpp": str(tiny_gguf)}, 2, 3, 4)
    assert len(out["round_ratios"]) == 3 and all(r > 0 for r in out["round_ratios"])
    rate = out["decode_tok_s"]
    assert rate["deltaserve"] > 0 and rate["llama.cpp"] > 0
    assert out["ratio"] == pytest.approx(rate["deltaserve"] / rate["llama.cpp"])
