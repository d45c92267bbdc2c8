"""fused.build_once, the compile-once-per-CPU step every process goes through: a build killed midway (Ctrl-C
during the first minute, a CI job cut off) must not block the next one, and processes starting together compile
once. Real builds through torch's extension builder, of a small module whose compiler run takes a few seconds
(a constexpr loop), so that a build can be killed while it holds torch's lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C++ compiler here")

NAME, SPIN = "deltaserve_build_probe", 1_000_000
SOURCE = """#include <Python.h>
constexpr long spin(long n) { long s = 0; for (long i = 0; i < n; ++i) s = (s * 31 + i) % 1000003; return s; }
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_NAME() {
  PyObject* m = PyModule_Create(&def);
  if (m) PyModule_AddIntConstant(m, "spun", spin(SPIN));
  return m;
}
"""
BUILD = """import sys
from pathlib import Path
from deltaserve.ops.fused import build_once
m = build_once(Path(sys.argv[1]), "NAME", Path(sys.argv[2]), ["-fconstexpr-loop-limit=2000000000",
               "-fconstexpr-ops-limit=100000000000"], what="the probe")
print(m.spun)
""".replace("NAME", NAME)


def spun(n: int) -> int:
    s = 0
    for i in range(n):
        s = (s * 31 + i) % 1000003
    return s


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "probe.cpp"
    path.write_text(SOURCE.replace("NAME", NAME).replace("SPIN", str(SPIN)))
    return path


def start(build: Path, source: Path) -> subprocess.Popen:
    # a session of its own: killing it kills ninja and the compiler too, as a Ctrl-C or a job's end does
    return subprocess.Popen([sys.executable, "-c", BUILD, str(build), str(source)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the build hung (waiting on a lock nobody holds?)")
    assert proc.returncode == 0, err[-2000:]
    return out, err


def test_a_killed_build_does_not_block_the_next(tmp_path, source):
    build = tmp_path / "build"
    first = start(build, source)
    deadline = time.monotonic() + 120
    while not (build / "lock").exists():  # torch's builder holds its lock file while it compiles
        assert first.poll() is None and time.monotonic() < deadline, "the first build never took torch's lock"
        time.sleep(0.005)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert (build / "lock").exists() and not (build / f"{NAME}.so").exists()  # what a killed build leaves
    out, err = finish(start(build, source))
    assert int(out) == spun(SPIN)
    assert "deltaserve: compiling the probe" in err


def test_processes_starting_together_compile_once(tmp_path, source):
    build = tmp_path / "build"
    procs = [start(build, source) for _ in range(3)]
    results = [finish(p) for p in procs]
    assert [int(out) for out, _ in results] == [spun(SPIN)] * 3
    assert sum("deltaserve: compiling the probe" in err for _, err in results) == 1
    out, err = finish(start(build, source))  # built: loaded without the builder
    assert int(out) == spun(SPIN) and err == ""


def test_a_failed_build_says_why_once(monkeypatch, capsys):
    """Where the kernels cannot be built (here: a compiler error), the torch paths run, 30-80x slower: say so once,
    with the reason, where a broken build had run on in silence (0.4 tok/s on a 0.8B model)."""
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("Error building extension 'deltaserve_cpu_kernels': plan.h:244: error\nmore lines")

    monkeypatch.setattr(fused, "extension", broken)
    fused.available.cache_clear()
    try:
        assert [fused.available() for _ in range(3)] == [False] * 3
        err = capsys.readouterr().err
    finally:
        fused.available.cache_clear()
    assert len(calls) == 1
    assert err.count("deltaserve: the CPU kernels are not available") == 1
    assert "Error building extension 'deltaserve_cpu_kernels': plan.h:244: error" in err and "more lines" not in err
