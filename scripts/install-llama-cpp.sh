#!/usr/bin/env bash
# Builds the llama.cpp peers into the project's venv (CPU only), for the parity tests and benchmarks:
#   scripts/install-llama-cpp.sh          llama-cpp-python (its Llama class; also the quantiser)
#   scripts/install-llama-cpp.sh server   llama-server, from the llama.cpp sources in llama-cpp-python's sdist
# Each takes about ten minutes on 2 cores; CI runs neither.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.3.36"
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "${1:-}" = "server" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  .venv/bin/pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work"
  tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >/dev/null
  cp "$work/build/bin/llama-server" .venv/bin/llama-server
  .venv/bin/llama-server --version 2>&1 | head -n 2
  exit 0
fi
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  .venv/bin/pip install --no-cache-dir "llama-cpp-python==$VERSION"
.venv/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
