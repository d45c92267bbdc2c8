"""What one client can take of the server is bounded: the body it sends, its stop strings, its place in
the queue, the work it leaves behind when it gives up, and the time its prompt holds the event loop."""

import concurrent.futures as cf
import json
import socket
import threading
import time

import httpx
import pytest

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import load
from deltaserve.server.app import create_app
from deltaserve.server.schemas import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS

from .conftest import PROMPT, LiveServer, assert_error, settled

# seconds /health may take: the stalls were 12-19 s; a machine shared with other jobs adds some
HEALTHY = 2.0


def body_of_size(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded with spaces, which JSON ignores)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def test_a_body_over_the_limit_is_a_413(make_server):
    live = make_server(max_request_bytes=64 * 1024)
    at_limit = httpx.post(live.url + "/v1/completions", content=body_of_size(64 * 1024), timeout=30,
                          headers={"content-type": "application/json"})
    assert at_limit.status_code == 200, at_limit.text
    over = httpx.post(live.url + "/v1/completions", content=body_of_size(64 * 1024 + 1), timeout=30,
                      headers={"content-type": "application/json"})
    assert assert_error(over, 413)["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_while_it_is_read(make_server):
    """No Content-Length: the limit holds as the chunks arrive, and the client still reads its 413."""
    live = make_server(max_request_bytes=64 * 1024)
    sent = []

    def chunks():
        for _ in range(200):  # 6.4 MB in 32 KB pieces
            sent.append(1)
            yield b"x" * 32 * 1024

    r = httpx.post(live.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert assert_error(r, 413)["code"] == "request_too_large"
    assert httpx.get(live.url + "/health", timeout=5).status_code == 200


def test_a_huge_body_at_the_default_limit(server, engine):
    """10 MB (the issue's prompt) is refused by its declared length; the server stays responsive and its
    memory does not grow by the body."""
    statm = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096  # noqa: E731
    before = statm()
    body = json.dumps({"prompt": "word " * 2_000_000, "max_tokens": 1}).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60, headers={"content-type": "application/json"})
    assert assert_error(r, 413)["code"] == "request_too_large"
    del body
    assert statm() - before < 50 * 2**20
    start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200 and time.monotonic() - start < HEALTHY


def test_a_long_prompt_under_the_limit_does_not_hold_up_health(server):
    """3.5 MB of text for a 512-token context: refused without tokenising it (about 5 s with the GIL held),
    and /health answers meanwhile."""
    body = json.dumps({"prompt": "word " * 700_000, "max_tokens": 1}).encode()
    with cf.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(httpx.post, server.url + "/v1/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})
        latencies = []
        while not refused.done():
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - start)
        assert assert_error(refused.result(), 400, "prompt")["code"] == "context_length_exceeded"
    assert max(latencies) < HEALTHY


@pytest.mark.parametrize("stop, fragment", [
    (["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"),
    (["y" * (MAX_STOP_CHARS + 1)], f"1 to {MAX_STOP_CHARS} characters"),
    ("z" * 100_000, f"1 to {MAX_STOP_CHARS} characters"),
    ([""], f"1 to {MAX_STOP_CHARS} characters"),
], ids=["too_many", "too_long", "one_huge_string", "empty"])
def test_stop_strings_are_bounded(server, stop, fragment):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": stop}, timeout=30)
    assert_error(r, 400, "stop", fragment)


def test_messages_are_bounded(server):
    """Each message is validated on the event loop: 60,000 of them held it for 0.6 s."""
    body = {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1), "max_tokens": 1}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), 400, "messages",
                 f"at most {MAX_MESSAGES}")


def test_the_most_stop_strings_allowed_cost_little(server):
    """16 stop strings of 1,000 characters on a 20-token request (the issue's 100k-character ones took 15 s)
    take about as long as none."""
    def seconds(**extra) -> float:
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, **extra})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        return time.monotonic() - start

    without = seconds()
    assert seconds(stop=[chr(0x4e00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]) < 2 * without + 0.5


@pytest.mark.parametrize("max_queue", [1, None], ids=["max_queue_1", "default"])
def test_a_full_queue_is_a_503_with_retry_after(make_server, engine, max_queue):
    """Every slot busy and max_queue requests waiting (by default twice the slots): the next one is refused
    at once; the others go on."""
    live = make_server(max_queue=max_queue)
    slots = engine.runner.n_slots
    waiting = 2 * slots if max_queue is None else max_queue
    responses = []
    stop = threading.Event()

    def hold(i: int):
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                          json={"prompt": f"{PROMPT} {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            responses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(slots + waiting)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while (engine.running(), engine.queue_depth()) != (slots, waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (engine.running(), engine.queue_depth()) == (slots, waiting)
        r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert assert_error(r, 503)["code"] == "queue_full"
        assert r.headers["retry-after"].isdigit()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert responses == [200] * (slots + waiting) and settled(engine)


def test_a_non_streaming_client_that_leaves_frees_its_slot(tiny_gguf):
    """The issue: a client that gave up after 1 s left its slot generating 4,000 tokens for 21 s. Now the
    server sees the closed connection while it waits and cancels the request, as for a stream."""
    model, tokenizer = load(tiny_gguf)
    engine = Engine(model, tokenizer, n_slots=2, max_len=4096, model_name="tiny")
    live = LiveServer(create_app(engine))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True},
                       timeout=httpx.Timeout(30, read=1.0))
        left = time.monotonic()
        assert settled(engine, seconds=1.5), "the slot still generates after its client left"
        assert time.monotonic() - left < 1.5
        assert engine.runner.free_slots() == 2
        assert engine.metrics.generated_tokens_total < 2000  # it stopped long before 4,000
    finally:
        live.stop()
        engine.close()


def test_a_client_that_leaves_mid_body_costs_nothing(server, engine):
    """Half a body, then the connection closes: no request reaches the engine, the server answers on."""
    requests = engine.metrics.requests_total
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"prompt\": \"hi")
    time.sleep(0.2)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert engine.metrics.requests_total == requests
