"""Servers the tests start in processes of their own: a free port to give them, and the wait for /health."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float) -> None:
    """Return once the server at `url` answers /health; raise with its stderr's end if it exits or is not up
    within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.25)
    raise RuntimeError(f"the server did not start: {proc.stderr.read()[-3000:] if proc.poll() is not None else ''}")
