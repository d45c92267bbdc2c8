import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from deltaserve.callforms import CallForm
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import LLM, load
from deltaserve.server.app import create_app

from tests.processes import free_port, wait_healthy

API_KEY = "test-key"
PROMPT = "To be, or not to be, that is the question"


class LiveServer:
    """uvicorn on a free loopback port, in a thread; stopped at the end of the session."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the test server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def engine(tiny_gguf):
    model, tokenizer = load(tiny_gguf)
    eng = Engine(model, tokenizer, n_slots=4, max_len=512, prefill_chunk=64, model_name="tiny")
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tool_engines(tmp_path_factory):
    """form -> an engine over a model fitted to answer toolmodel.conversations(form) with tool calls."""
    from .toolmodel import WEATHER, fitted_tool_model

    made = {}

    def get(form):
        if form not in made:
            path = fitted_tool_model(tmp_path_factory.mktemp("tool") / f"{form.value}.gguf", [WEATHER], form)
            model, tokenizer = load(path)
            made[form] = Engine(model, tokenizer, n_slots=2, max_len=1024, prefill_chunk=64, model_name="tool")
        return made[form]

    yield get
    for eng in made.values():
        eng.close()


@pytest.fixture(scope="session")
def tool_engine(tool_engines):
    return tool_engines(CallForm.XML)


@pytest.fixture(scope="session")
def tool_server(tool_engine):
    live = LiveServer(create_app(tool_engine))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def server(engine):
    live = LiveServer(create_app(engine))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def secured_server(engine):
    live = LiveServer(create_app(engine, api_key=API_KEY))
    yield live
    live.stop()


@pytest.fixture
def make_server(engine):
    """make_server(**create_app options) -> a LiveServer over the shared engine, stopped after the test."""
    made = []

    def make(**options) -> LiveServer:
        made.append(LiveServer(create_app(engine, **options)))
        return made[-1]

    yield make
    for live in made:
        live.stop()


def settled(engine, seconds: float = 30) -> bool:
    """Whether the engine holds no request (running or queued) within `seconds`."""
    deadline = time.monotonic() + seconds
    while engine.running() or engine.queue_depth():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_error(response, status: int, param: str | None = "", fragment: str = ""):
    """An OpenAI-style error body with `status` (and `param` unless ""), its message holding `fragment`."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str)
    assert fragment in body["error"]["message"], body
    if param != "":
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.fixture
def spawn(tiny_gguf):
    """spawn(*serve options) -> (process, url) of `deltaserve serve` on the tiny model in its own process
    (its event loop shares no GIL with the test's clients), answering /health; killed at the end of the
    test if it still runs."""
    procs = []

    def start(*options: str):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "serve", str(tiny_gguf), "--port", str(port),
                                 "-t", "2", *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "DELTASERVE_NO_PROGRESS": "1"})
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    """The real openai client on the module's server (structured decoding may take minutes on a loaded machine)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def reference(tiny_gguf):
    """The same model run alone through LLM: what every server answer must equal (greedy)."""
    return LLM(tiny_gguf, max_len=512)
