#!/usr/bin/env bash
# Builds llama-cpp-python (llama.cpp from source, CPU only) into the project's venv, for the
# parity tests and bench/compare.py. Takes about ten minutes on 2 cores; CI does not run it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  .venv/bin/pip install --no-cache-dir "llama-cpp-python==0.3.36"
.venv/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
