"""llama.cpp through llama-cpp-python, the peer of the benchmarks, the fidelity scripts and the parity tests, opened
so that it runs on every CPU here.

On a CPU with AMX (Intel Sapphire Rapids and later) llama.cpp moves a quantised file's matrices into its AMX buffer
type, and its matmul there segfaults on every quantised file we make (Q4_K_M, Q8_0, IQ4_XS, qwen35moe Q4_K_M: 0.8B
presets, llama-cpp-python 0.3.36, lscpu "Intel(R) Xeon(R) Processor" with amx_int8; llama.cpp issue #20824 reports
the same crash in ggml_backend_amx_mul_mat on Q4_K_M files). On such a CPU the model is opened without llama.cpp's
extra buffer types (`use_extra_bufts = False`), so its AVX-512 VNNI kernels run: the same Q8_K / Q8_0 arithmetic.
llama-cpp-python's Llama has no argument for it; it reads llama_model_default_params() while it loads, so that is
what is wrapped, for that one call.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def amx_cpu() -> bool:
    """Whether this CPU has AMX (llama.cpp's AMX buffer type would take the quantised matrices)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def open_llama(model_path, **kwargs):
    """llama_cpp.Llama(model_path, **kwargs), without llama.cpp's extra buffer types where this CPU has AMX."""
    import llama_cpp
    import llama_cpp.llama as high_level

    if not amx_cpu():
        return llama_cpp.Llama(model_path=str(model_path), **kwargs)
    defaults = high_level.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    high_level.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(model_path), **kwargs)
    finally:
        high_level.llama_cpp.llama_model_default_params = defaults


def cpu_features() -> str:
    """The instruction sets this llama.cpp's CPU kernels were built with (its system info's "X = 1" entries): which
    of its kernels ran, as the benchmark says beside its figures."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return " ".join(part.split("=")[0].strip() for part in info.replace("CPU :", "|").split("|")
                    if part.strip().endswith("= 1"))


def note() -> str:
    """What the benchmarks print beside llama.cpp's figures: what its kernels were built with, and that it ran
    without its AMX buffers where this CPU has AMX."""
    built = f"llama.cpp's CPU kernels built with: {cpu_features()}"
    if not amx_cpu():
        return built
    return (f"{built}; it ran without its extra buffer types (use_extra_bufts = False): on this AMX CPU its AMX matmul "
            "segfaults on quantised files (llama.cpp #20824)")
