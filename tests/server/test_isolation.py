"""One request never harms another, through the live server: extreme but valid sampling values generate
(and leave a request beside them exactly as it is alone); invalid values get an OpenAI-style 400 naming
the field, never a 500."""

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import LLM, load
from deltaserve.server.app import create_app

from .conftest import API_KEY, PROMPT, LiveServer, assert_error, settled


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """The same model run alone through LLM: greedy token ids every server answer must equal."""
    llm = LLM(tiny_gguf, max_len=512)
    return lambda prompt, n: llm.generate(prompt, max_tokens=n, temperature=0).token_ids


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    """POST `body` as ASCII JSON (an unpaired surrogate travels as its \\u escape, as JSON allows)."""
    return httpx.post(server.url + path, content=json.dumps(body), timeout=timeout,
                      headers={"content-type": "application/json"})


def stream_ids(server, body: dict) -> tuple[list[int], str]:
    """The token ids of a streamed completion (return_token_ids) and its last data line before [DONE]."""
    ids, lines = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lines.append(line)
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
            elif line == "data: [DONE]":
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    return ids, lines[-2]


EXTREMES = [{"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 5e-324},
            {"temperature": 2.0, "min_p": 5e-324, "top_k": 10**30}, {"temperature": 1e-300, "seed": 2**64 - 1}]


@pytest.mark.parametrize("values", EXTREMES, ids=["temp_1e-40", "temp_denormal", "top_p_denormal", "min_p_tiny",
                                                  "seed_max"])
def test_extreme_values_alone_and_beside_a_normal_request(server, engine, reference, values):
    """The issue's case: these values ended the batch with a 500. Alone they generate (a temperature too
    small to divide by is greedy); beside them, a greedy stream gets exactly its tokens alone."""
    body = {"prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, **values}
    alone = post(server, "/v1/completions", body)
    assert alone.status_code == 200, alone.text
    ids = alone.json()["choices"][0]["token_ids"]
    assert len(ids) == 8 or alone.json()["choices"][0]["finish_reason"] == "stop"
    if values["temperature"] < 1e-5 or values.get("top_p", 1) < 1e-30:
        assert ids == reference(PROMPT, 8)
    with cf.ThreadPoolExecutor(2) as pool:
        normal = pool.submit(stream_ids, server, {"prompt": "Hello there", "max_tokens": 24, "temperature": 0})
        time.sleep(0.2)  # the normal stream is decoding when the extreme one joins its batch
        extreme = pool.submit(post, server, "/v1/completions", {**body, "prompt": "Good morrow"})
        assert extreme.result().status_code == 200, extreme.result().text
        assert normal.result()[0] == reference("Hello there", 24)
    assert settled(engine)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_seed_out_of_range_is_a_400(server, seed):
    assert_error(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": seed}), 400, "seed")


def test_seeds_at_the_edges_of_the_range_are_reproducible(server):
    for seed in (2**64 - 1, -2**63):
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": seed}
        texts = {post(server, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)}
        assert len(texts) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "abc\ud800def"}, "prompt"),
    ("/v1/completions", {"prompt": "\udfff"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content"),
], ids=["lone_high", "lone_low", "chat_content", "chat_part"])
def test_unpaired_surrogates_are_a_400(server, path, body, param):
    """The tokenizer raised TypeError on them: a plain-text 500."""
    error = assert_error(post(server, path, {**body, "max_tokens": 2}), 400, param, "surrogate")
    assert error["type"] == "invalid_request_error"


def test_a_surrogate_pair_is_a_character(server):
    r = post(server, "/v1/completions", {"prompt": "smile \ud83d\ude00", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content, fragment", [
    ([{"type": "text", "text": 42}], "'text' must be a string"),
    ([{"type": "text", "text": None}], "'text' must be a string"),
    ([{"type": "text"}], "'text' must be a string"),
    ([{"type": "image_url", "image_url": {"url": "http://x"}}], "only parts of type 'text'"),
    (["just a string in a list"], "only parts of type 'text'"),
    (7, "string or a list of text parts"),
], ids=["int_text", "null_text", "no_text", "image", "bare_string", "number"])
def test_bad_content_parts_are_a_400(server, content, fragment):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages.0.content", fragment)


def test_text_parts_are_joined(server, reference):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    one = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 4,
                                                "temperature": 0})
    joined = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                                   "max_tokens": 4, "temperature": 0})
    assert one.status_code == 200 and one.json()["choices"] == joined.json()["choices"]


def test_return_token_ids(server, reference):
    """token_ids in each choice and each chunk (vLLM's extension): the chunks' join to the whole answer's,
    which are the model's greedy tokens alone."""
    expected = reference(PROMPT, 12)
    full = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                            "return_token_ids": True}).json()
    assert full["choices"][0]["token_ids"] == expected
    assert stream_ids(server, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})[0] == expected
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                 "temperature": 0, "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}).json()
    assert "token_ids" not in plain["choices"][0]


def test_tokenizer_ids_past_the_embedding_are_a_400(tiny_gguf):
    """A tokenizer with more ids than the model's embedding has rows (here the embedded model's 4,096-token
    tokenizer over the tiny model's few hundred rows): string prompts are range-checked too."""
    model, _ = load(tiny_gguf)
    _, big_tokenizer = load(None)
    engine = Engine(model, big_tokenizer, n_slots=1, max_len=512, model_name="mismatch")
    live = LiveServer(create_app(engine))
    try:
        ids = big_tokenizer.encode("ROMEO: what light")
        assert max(ids) >= engine.vocab_size
        error = assert_error(post(live, "/v1/completions", {"prompt": "ROMEO: what light", "max_tokens": 2}), 400,
                             "prompt", "does not match")
        assert error["code"] == "token_out_of_range"
        assert_error(post(live, "/v1/completions", {"prompt": [1, 900], "max_tokens": 2}), 400, "prompt", f"[0, {engine.vocab_size})")
        ok = post(live, "/v1/completions", {"prompt": [min(ids)], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        live.stop()
        engine.close()


@pytest.mark.parametrize("header", [b"Bearer wrong", b"Bearer " + API_KEY.encode() + b"x", b"Bearer \xff\xfe",
                                    b"bearer " + API_KEY.encode(), b""],
                         ids=["wrong", "longer", "not_ascii", "lowercase_scheme", "empty"])
def test_a_wrong_key_is_a_401(secured_server, header):
    r = httpx.post(secured_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={"authorization": header}, timeout=30)
    assert assert_error(r, 401)["code"] == "invalid_api_key"


def test_the_right_key_is_a_200(secured_server):
    r = httpx.post(secured_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30,
                   headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("method, path, status", [("get", "/v1/nothing", 404), ("get", "/v1/completions", 405),
                                                  ("delete", "/health", 405)])
def test_unknown_routes_and_methods_are_json(server, method, path, status):
    assert_error(getattr(httpx, method)(server.url + path, timeout=30), status)


def test_an_engine_error_is_a_json_500_naming_no_internals(tiny_gguf):
    """A model whose vocabulary is larger than its tokenizer's (the embedded model's 4,096 ids under the
    tiny tokenizer's) samples ids the tokenizer cannot decode: that request fails inside the engine.
    The client gets a JSON 500 (or a final error event) that says so without the exception's text; the
    engine goes on serving."""
    model, _ = load(None)
    _, small_tokenizer = load(tiny_gguf)
    engine = Engine(model, small_tokenizer, n_slots=2, max_len=256, model_name="mismatch")
    live = LiveServer(create_app(engine))
    body = {"prompt": "ROMEO:", "max_tokens": 50, "temperature": 2.0, "seed": 1, "ignore_eos": True}
    try:
        r = post(live, "/v1/completions", body)
        error = assert_error(r, 500, None, "the engine failed")
        assert (error["type"], error["code"]) == ("server_error", "engine_error")
        assert "vocabulary" not in r.text and "Error" not in r.text and "Traceback" not in r.text
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "engine_error"
        assert post(live, "/v1/completions", {**body, "max_tokens": 0}).status_code == 200
        assert settled(engine) and engine.runner.free_slots() == 2
    finally:
        live.stop()
        engine.close()
