#!/usr/bin/env bash
# Compile the CPU kernels for this CPU and for the other instruction sets the test suite builds where this CPU can
# run them (tests/builds.py run_in_build: x86-64-v3, x86-64-v2, skylake-avx512, alderlake, cascadelake), as many at
# once as there are cores. Each build lands in ~/.cache/deltaserve keyed by its source, where the tests find it
# (fused.build_once: a test that needs one still being compiled waits for it). .ci/run runs this before pytest:
# compiled one after another inside the tests, these builds took ~9 of a clean clone's 20 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null) "
has() { [[ $flags == *" $1 "* ]]; }
marches="native"
if has avx512f; then
  marches+=" x86-64-v3 x86-64-v2 skylake-avx512"
  if has avx512vbmi; then marches+=" cascadelake"; fi
elif has avx2; then
  marches+=" x86-64-v2"
fi
if has avx_vnni; then marches+=" alderlake"; fi
printf '%s\n' $marches | xargs -P "$(nproc 2>/dev/null || echo 2)" -I{} \
  env DELTASERVE_MARCH={} "$py" -c "from deltaserve.ops import fused; assert fused.available(), 'the {} build failed'"
