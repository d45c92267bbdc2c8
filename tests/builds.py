"""Tests of a file run against the kernels built for an older target (DELTASERVE_MARCH: x86-64-v3 is AVX2, x86-64-v2
portable C++), in a subprocess: an AVX-512 machine checks its fallback paths this way."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest


def run_in_build(test_file: str, march: str, select: str, needs: str = "avx512f", check: str | None = None) -> None:
    """Run the tests of `test_file` that `select` (-k) picks with the kernels built for `march`; skipped where this
    CPU lacks `needs` (its own build is then already a fallback). check: Python run first in that build."""
    if platform.machine() != "x86_64" or needs not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"no {needs} here: this machine's own build already runs a fallback path")
    env = dict(os.environ, DELTASERVE_MARCH=march)
    if check is not None:
        done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=1100)
        assert done.returncode == 0, done.stderr[-2000:]
    run_with(test_file, select, env)


def run_with(test_file: str, select: str, env: dict) -> None:
    """Run the tests of `test_file` that `select` (-k) picks in a subprocess with environment `env`; they must pass."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", select],
                          env=env, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]
