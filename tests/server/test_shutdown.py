"""`deltaserve serve` shuts down in seconds: on SIGTERM or SIGINT it stops taking requests, ends every
stream with a final event and [DONE] and every waiting request with a 503, and exits within 5 s (a
second signal: at once), instead of waiting for every generation to finish."""

import json
import signal
import socket
import threading
import time

import httpx
import pytest


@pytest.fixture
def serve(spawn):
    return lambda: spawn("-c", "4096", "--slots", "4")


class Stream(threading.Thread):
    """A streamed completion of 3,000 tokens, read to its end; `started` once text has come."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.url, self.i, self.lines, self.started, self.error = url, i, [], threading.Event(), None

    def run(self):
        try:
            body = {"prompt": f"Stream {self.i}:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e


def final_event(lines: list[str]) -> dict:
    """The event before [DONE], which must end the stream."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2][6:])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_stream_and_exits_within_5s(serve, sig):
    proc, url = serve()
    streams = [Stream(url, i) for i in range(6)]  # 4 decode, 2 wait for a slot
    for s in streams:
        s.start()
    assert all(s.started.wait(60) for s in streams[:4])
    waiting = {}
    waiter = threading.Thread(target=lambda: waiting.update(r=httpx.post(
        url + "/v1/completions", json={"prompt": "wait", "max_tokens": 3000, "ignore_eos": True}, timeout=60)))
    waiter.start()
    time.sleep(0.5)
    signalled = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=10)
    assert time.monotonic() - signalled < 5
    for s in [*streams, waiter]:
        s.join(timeout=5)
    for s in streams:
        assert s.error is None and s.lines, s.error
        event = final_event(s.lines)
        assert event.get("error", {}).get("code") == "server_shutting_down" or event["choices"][0]["finish_reason"]
    assert waiting["r"].status_code == 503 and waiting["r"].json()["error"]["code"] == "server_shutting_down"
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("second_signal", [False, True], ids=["one_signal", "two_signals"])
def test_a_client_that_sends_half_a_body_delays_the_exit_2s_at_most(serve, second_signal):
    """Its connection stays open and the server waits for it, for at most 2 s (GRACE_SECONDS); a second signal stops the
    wait at once."""
    proc, url = serve()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as stuck:
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert proc.poll() is None  # still waiting for the stuck connection
        if second_signal:
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - signalled < (1 if second_signal else 5)
