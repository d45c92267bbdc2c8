"""`deltaserve bench MODEL`'s workers and table (bench/compare.py): each engine's RSS after its imports, measured
in the worker before the model loads, against the same imports in a fresh interpreter; the RSS past them."""

import argparse
import subprocess
import sys

import pytest

from deltaserve.bench import compare


def fresh_rss_mb(code: str) -> float:
    """Peak RSS of a new interpreter that runs `code`, as the kernel counts its address space (VmHWM; this test's
    own process is large, and getrusage would hand its size on to the child): what the imports cost."""
    probe = f"{code}\nprint(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.split()[-1]) / 1024


def worker_args(model, **over) -> argparse.Namespace:
    args = dict(model=str(model), peer_model=None, threads=2, batch=64, prefill=[40], decode=3, dtype="float32",
                cache_mb=0.0)
    return argparse.Namespace(**{**args, **over})


def test_deltaserve_worker_measures_its_imports_before_the_model(tiny_gguf):
    run = compare._run_worker("deltaserve", worker_args(tiny_gguf))
    alone = fresh_rss_mb("import torch\nfrom deltaserve.engine.llm import LLM")
    assert abs(run["import_rss_mb"] - alone) < 0.1 * alone, (run["import_rss_mb"], alone)
    assert run["peak_rss_mb"] > run["import_rss_mb"]  # the model, its state and the passes come on top
    # the GEMVs' passes, each paired with a read of as many bytes: rates, and the share their median ratio gives
    assert run["gemv_gbps"] > 0 and run["read_beside_gbps"] > 0 and run["gemv_share"] > 0


def test_the_peers_worker_carries_no_torch():
    """llama.cpp's worker runs this module: importing it must not bring torch's ~200 MB into the peer's RSS."""
    done = subprocess.run([sys.executable, "-c", "import sys, deltaserve.bench.compare; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "torch" not in done.stdout.split()


def test_llama_worker_measures_its_imports_before_the_model(tiny_gguf):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")
    run = compare._run_worker("llama.cpp", worker_args(tiny_gguf))
    alone = fresh_rss_mb("import llama_cpp, numpy\nimport deltaserve.bench.compare")
    assert abs(run["import_rss_mb"] - alone) < 0.1 * alone, (run["import_rss_mb"], alone)
    assert run["peak_rss_mb"] > run["import_rss_mb"]


def test_table_sets_the_imports_aside(capsys):
    runs = {"deltaserve": [dict(prefill_40=100.0, decode=10.0, peak_rss_mb=900.0, import_rss_mb=240.0),
                           dict(prefill_40=120.0, decode=12.0, peak_rss_mb=920.0, import_rss_mb=236.0)],
            "llama.cpp": [dict(prefill_40=50.0, decode=5.0, peak_rss_mb=720.0, import_rss_mb=40.0),
                          dict(prefill_40=50.0, decode=6.0, peak_rss_mb=724.0, import_rss_mb=40.0)]}
    median = compare._table(worker_args("m.gguf", reps=2), ["deltaserve", "llama.cpp"], runs)
    # by hand: deltaserve's runs hold 660 and 684 MB past their imports, llama.cpp's 680 and 684
    assert median["deltaserve"]["rss_past_imports_mb"] == 672.0 and median["llama.cpp"]["rss_past_imports_mb"] == 682.0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rss_past_imports_mb"))
    assert row.split()[-3:] == ["672.0", "682.0", f"{672 / 682:.2f}x"]


def test_the_peers_note_names_what_its_kernels_were_built_with():
    """The table says which instruction sets llama.cpp's CPU kernels were built with (its own system info's "X = 1"
    entries, none of its "X = 0" ones): a peer built for AVX2 on an AVX-512 machine runs AVX2 kernels."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-llama-cpp.sh)")
    from deltaserve.bench import llama_peer

    info = llama_cpp.llama_print_system_info().decode()
    features = llama_peer.cpu_features().split()
    assert features and all(f"{f} = 1" in info for f in features)
    assert not [f for f in ("AVX2", "AVX512", "AVX512_VNNI", "FMA") if f"{f} = 1" in info and f not in features]
    assert llama_peer.cpu_features() in llama_peer.note()
