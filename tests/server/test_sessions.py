"""Multi-turn sessions through the openai SDK: each turn reuses the history its prompt shares with the
last one (the template drops the thinking block, so the new prompt leaves the old one where the assistant's
turn started), the output is what a cold prefill gives, and a restarted server keeps its checkpoints."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import load
from deltaserve.server.app import create_app

from .conftest import LiveServer, free_port

openai = pytest.importorskip("openai")

USERS = ["Where does the river start?", "And what do farmers say of it?", "Tell me about the bread.",
         "What did the woman count on the train?"]


def converse(client, turns, **extra):
    """(answer, prompt tokens, cached tokens) per turn, each answer carried into the next turn's history."""
    history, out = [{"role": "system", "content": "Answer in a few words."}], []
    for text in turns:
        history.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0,
                                               extra_body=extra)
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        out.append((reply.choices[0].message.content, reply.usage.prompt_tokens,
                    reply.usage.prompt_tokens_details.cached_tokens))
    return out, history


@pytest.fixture
def live(tiny_gguf):
    model, tokenizer = load(tiny_gguf)
    engine = Engine(model, tokenizer, n_slots=2, max_len=1024, prefill_chunk=64, model_name="tiny",
                    checkpoint_interval=64)
    server = LiveServer(create_app(engine))
    yield server, engine
    server.stop()
    engine.close()


def test_each_turn_prefills_only_its_new_tokens(live):
    server, engine = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    cached, history = converse(client, USERS)
    tok = engine.tokenizer
    for turn in range(1, len(USERS)):  # the prompt of the turn before, and where this one leaves it
        before = tok.encode(tok.chat_prompt(history[:2 * turn]))
        now = tok.encode(tok.chat_prompt(history[:2 * turn + 2]))
        shared = next(i for i, (a, b) in enumerate(zip(before, now)) if a != b)
        assert shared < len(before)  # the history was re-rendered: the live state alone cannot serve it
        assert cached[turn][2] == shared and cached[turn][1] == len(now)
        assert shared >= 0.95 * len(before) - 8  # all but the generation prompt's thinking block
    cold, _ = converse(client, USERS, cache_prompt=False)
    assert [c[0] for c in cold] == [c[0] for c in cached] and all(c[2] == 0 for c in cold)
    metrics = httpx.get(server.url + "/metrics").text
    assert "deltaserve_cache_hits_total" in metrics and "deltaserve_cached_prompt_tokens_total" in metrics
    hits = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("deltaserve_cache_hits_total")))
    assert hits >= len(USERS) - 1


def serve(path, cache_dir, port):
    env = {**os.environ, "DELTASERVE_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "serve", str(path), "--port", str(port),
                             "--slots", "1", "-c", "1024", "--cache-dir", str(cache_dir), "--served-model-name", "tiny"], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start: " + proc.stderr.read())


def test_a_restarted_server_keeps_its_checkpoints(tiny_gguf, tmp_path):
    port = free_port()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    proc = serve(tiny_gguf, tmp_path, port)
    try:
        first, history = converse(client, USERS[:2])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "prefix checkpoints saved" in err
    proc = serve(tiny_gguf, tmp_path, port)
    try:
        history.append({"role": "user", "content": USERS[2]})
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    tok = load(tiny_gguf)[1]
    shared_prompt = tok.encode(tok.chat_prompt(history[:4]))
    assert reply.usage.prompt_tokens_details.cached_tokens == tok.reply_start(history[:4], shared_prompt)
