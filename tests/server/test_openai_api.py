"""The real openai client against a live server on loopback."""

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from .conftest import API_KEY, PROMPT


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_matches_the_engine_alone(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    expected = reference.generate(PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(reference.tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_completion_from_token_ids(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == reference.generate(ids, max_tokens=5, temperature=0).text


def test_streaming_completion_with_usage(client, reference):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.generate(PROMPT, max_tokens=12, temperature=0).text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_uses_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body=NO_THINKING)
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    expected = reference.generate(prompt, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))


def test_chat_streaming_and_max_completion_tokens(client, reference):
    messages = [{"role": "user", "content": "Tell me a story"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert text == reference.generate(prompt, max_tokens=8, temperature=0).text
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_strings(client, reference):
    full = reference.generate(PROMPT, max_tokens=30, temperature=0).text
    assert len(full) > 8
    stop = full[5:8]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert out.choices[0].text == full[:full.find(stop)] and out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=11)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_requests_are_isolated_among_concurrent_ones(client, reference):
    prompts = [f"{PROMPT} {i}" * (1 + i % 3) for i in range(9)]
    expected = [reference.generate(p, max_tokens=10, temperature=0).text for p in prompts]
    with cf.ThreadPoolExecutor(9) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                 temperature=0).choices[0].text, prompts))
    assert got == expected


@pytest.mark.parametrize("body, status, fragment", [
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10 ** 9}, 400, "context"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [10 ** 8]}, 400, "token ids"),
    ({"prompt": "word " * 600}, 400, "context"),
    ({}, 400, "prompt"),
], ids=["negative_max", "huge_max", "string_max", "negative_temp", "unknown_model", "empty", "oov_ids", "too_long",
        "no_prompt"])
def test_bad_completion_requests(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]


@pytest.mark.parametrize("body, fragment", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": "hello"}, "messages"),
], ids=["empty_messages", "bad_role", "not_a_list"])
def test_bad_chat_requests(server, body, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_malformed_json_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)


def test_metrics_are_prometheus_text(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("requests_total", "generated_tokens_total", "prefill_tokens_per_second", "decode_tokens_per_second",
                 "queue_depth", "cache_bytes"):
        assert f"deltaserve_{name}" in values
    assert values["deltaserve_generated_tokens_total"] >= 3 and values["deltaserve_cache_bytes"] > 0


def test_api_key_guards_every_route_but_health_and_the_chat_page(secured_server):
    url = secured_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/").status_code == 200  # the page holds no data: it asks for the key itself
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("get", "/metrics"),
                         ("post", "/v1/chat/completions"), ("get", "/index.html"), ("post", "/v1/responses"),
                         ("get", "/v1/models/tiny"), ("get", "/props")]:
        r = getattr(httpx, method)(url + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_disconnected_stream_frees_its_slot(server, engine):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 400, "stream": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # leave after the first piece of text
    deadline = time.time() + 20
    while time.time() < deadline and (engine.running() or engine.queue_depth()):
        time.sleep(0.05)
    assert engine.running() == 0 and engine.runner.free_slots() == engine.runner.n_slots
    assert engine.metrics.generated_tokens_total < engine.metrics.requests_total * 400  # it did not run to the end
