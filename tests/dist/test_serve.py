"""`torchrun --nproc-per-node 2 -m deltaserve serve MODEL --pp 2`, asked by the openai SDK: the greedy
completion of one process; every rank gone after SIGTERM; and a hung rank ends the server with the error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from deltaserve.engine.llm import LLM

from tests.processes import free_port, wait_healthy


@pytest.fixture
def two_ranks(model_path):
    """start(*options) -> (torchrun process, url) serving the tiny qwen35 model in 2 stages; killed at the end."""
    procs = []

    def start(*options: str):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "deltaserve", "serve", str(model_path("qwen35")), "--port", str(port), "--pp", "2", *options]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), DELTASERVE_NO_PROGRESS="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 180)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of the worker torchrun started as `rank` (its children differ only by RANK in their environment)."""
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"PPid:\t{torchrun.pid}\n" in status and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise LookupError(f"no rank {rank} under {torchrun.pid}")


def test_a_two_rank_server_answers_as_one_process_and_stops_whole(two_ranks, model_path):
    proc, url = two_ranks("--slots", "2")
    client = OpenAI(base_url=url + "/v1", api_key="none")
    got = client.completions.create(model=model_path("qwen35").stem, prompt="ROMEO:", max_tokens=10, temperature=0)
    want = LLM(model_path("qwen35")).generate("ROMEO:", max_tokens=10, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks; rank 1 also hears rank 0 stop
    assert proc.wait(timeout=60) is not None


def test_a_hung_rank_ends_the_server_with_the_error(two_ranks, model_path):
    proc, url = two_ranks("--dist-timeout", "5")
    os.kill(_rank_pid(proc, 1), signal.SIGSTOP)
    began = time.monotonic()
    reply = httpx.post(url + "/v1/completions", json={"model": model_path("qwen35").stem, "prompt": "ROMEO:",
                                                      "max_tokens": 4}, timeout=60)
    assert reply.status_code >= 500 or "error" in reply.text, reply.text
    assert proc.wait(timeout=90) != 0  # rank 0 exits with the error; torchrun then ends the stopped rank
    assert time.monotonic() - began < 5 + 60
    err = proc.stderr.read()  # the request's pass or an idle heartbeat, whichever found the rank first
    assert "deltaserve: error: rank 0: '" in err and "hung for more than 5 s" in err, err[-3000:]
