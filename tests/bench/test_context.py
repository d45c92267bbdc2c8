"""`deltaserve bench MODEL --prompt ...`, run as a user runs it: a subprocess, its table and its JSON."""

import json
import subprocess
import sys

import pytest


def bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "deltaserve.cli", "bench", *map(str, args)], text=True,
                          capture_output=True, timeout=timeout, env={"DELTASERVE_NO_PROGRESS": "1", "PATH": ""})


def test_prompt_lengths_each_measured_beside_llama_cpp(tiny_gguf, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")
    out = tmp_path / "context.json"
    done = bench(tiny_gguf, "--against", "llama.cpp", "--prompt", "40,600", "--decode", "3", "--json", out)
    assert done.returncode == 0, done.stderr
    median = json.loads(out.read_text())["median"]
    assert set(median) == {"40", "600"}
    for n, by in median.items():
        for engine in ("deltaserve", "llama.cpp"):
            assert by[engine]["prefill"] > 0 and by[engine]["decode"] > 0 and by[engine]["peak_rss_mb"] > 0
        # the memory deltaserve holds is reported, and is part of its peak RSS
        mine = by["deltaserve"]
        assert mine["peak_rss_mb"] > mine["state_mb"] + mine["checkpoint_mb"]
    assert median["600"]["deltaserve"]["checkpoints"] >= 1  # the 600-token prompt passed position 512
    for line in ("prefill tok/s", "decode tok/s", "peak RSS MB", "prefix checkpoints"):
        assert line in done.stdout


@pytest.mark.parametrize("value", ["0", "512,x", ""])
def test_bad_prompt_lengths_are_named(tiny_gguf, value):
    done = bench(tiny_gguf, "--prompt", value, timeout=120)
    assert done.returncode == 2 and "--prompt" in done.stderr
