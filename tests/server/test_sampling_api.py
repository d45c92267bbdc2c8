"""Sampling parameters, logprobs, echo, batched prompts, n choices, /tokenize and CORS through the real openai
client against a live server, checked against the same model run alone (LLM) and scored by LLM.score."""

import httpx
import openai
import pytest
import torch

from .conftest import PROMPT


def raw_logprobs(reference, ids):
    """float64 log_softmax of the logits after each of ids (a fresh scoring pass): [len(ids), V]."""
    return reference.score(ids).double().log_softmax(-1)


def test_penalties_and_logit_bias_act_as_in_the_engine(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    greedy = reference.generate(ids, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    bias = {greedy[0]: -100, greedy[1]: 3.0}
    expected = reference.generate(ids, max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1.5,
                                  frequency_penalty=0.7, repetition_penalty=1.3, logit_bias=bias, min_tokens=4)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, presence_penalty=1.5,
                                    frequency_penalty=0.7, logit_bias={str(k): v for k, v in bias.items()},
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 4,
                                                "return_token_ids": True})
    assert greedy[0] not in out.choices[0].token_ids
    assert out.choices[0].token_ids == expected.token_ids != greedy


def test_stop_token_ids_end_a_chat(client, reference):
    messages = [{"role": "user", "content": "Hello"}]
    free = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = free.choices[0].token_ids
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "stop_token_ids": [ids[3]]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].token_ids == ids[:ids.index(ids[3])]


def test_chat_logprobs_have_openais_shape_and_the_models_values(client, reference):
    messages = [{"role": "user", "content": "Tell me a story"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.8, seed=5,
                                         logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    prompt = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages))
    ref = raw_logprobs(reference, prompt + choice.token_ids)[len(prompt) - 1:-1]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids) == 6
    # the template opened a thinking block, so the reply (no </think> in it) is all reasoning_content
    text = (choice.message.model_extra.get("reasoning_content") or "") + (choice.message.content or "")
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == text
    for entry, token, row in zip(content, choice.token_ids, ref):
        assert entry.bytes == list(reference.tokenizer.token_bytes(token))
        assert abs(entry.logprob - float(row[token])) < 1e-4
        best = row.topk(3)
        assert [e.bytes for e in entry.top_logprobs] == [list(reference.tokenizer.token_bytes(t))
                                                         for t in best.indices.tolist()]
        torch.testing.assert_close([e.logprob for e in entry.top_logprobs], best.values.tolist(), atol=1e-4, rtol=0)
    streamed = [e for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0.8, seed=5, logprobs=True, top_logprobs=3,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    torch.testing.assert_close([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-5, rtol=0)


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [reference.tokenizer.token_bytes(t).decode() for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = raw_logprobs(reference, ids)
    torch.testing.assert_close(lp.token_logprobs[1:], [float(ref[i, t]) for i, t in enumerate(ids[1:])],
                               atol=1e-4, rtol=0)
    for i, top in enumerate(lp.top_logprobs[1:]):
        best = ref[i].topk(2)
        names = [reference.tokenizer.token_bytes(t).decode(errors="replace") for t in best.indices.tolist()]
        assert list(top) == list(dict.fromkeys(names))  # a token read as U+FFFD may share its key
    assert [PROMPT[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_echo_stream_starts_with_the_prompt(client, reference):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == PROMPT + reference.generate(PROMPT, max_tokens=5, temperature=0).text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert [text[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-lists"])
def test_a_list_of_prompts_gives_one_choice_each(client, reference, as_ids):
    prompts = [PROMPT, "Once upon a time", "ROMEO:"]
    sent = [reference.tokenizer.encode(p) for p in prompts] if as_ids else prompts
    out = client.completions.create(model="tiny", prompt=sent, max_tokens=7, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [reference.generate(p, max_tokens=7, temperature=0).text for p in prompts]
    assert out.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_langchain_openai_sends_a_list_of_prompts(server, reference):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = langchain_openai.OpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", max_tokens=6,
                                  temperature=0, batch_size=3, max_retries=0)
    prompts = [PROMPT, "Once upon a time", "ROMEO:"]
    out = llm.generate(prompts)
    assert [g[0].text for g in out.generations] == [reference.generate(p, max_tokens=6, temperature=0).text
                                                   for p in prompts]


def test_n_choices_each_follow_their_own_seed(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, n=3,
                                    extra_body={"ignore_eos": True})
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [reference.generate(PROMPT, max_tokens=8, temperature=1.0, seed=40 + i, ignore_eos=True).text
                     for i in range(3)]
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3, stream=True)
    indices = {c.choices[0].index: c.choices[0].finish_reason for c in chat if c.choices and
               c.choices[0].finish_reason}
    assert indices == {0: "length", 1: "length"}


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=5), "n"), (dict(logit_bias={"99999999": 1}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"), (dict(extra_body={"min_tokens": -1}), "min_tokens"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"), (dict(logprobs=True, top_logprobs=21),
                                                                          "top_logprobs")])
def test_out_of_range_values_get_a_400_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       **kwargs)
    assert info.value.body["param"].split(".")[0] == param


def test_tokenize_and_detokenize_in_both_shapes(server, reference):
    ids = reference.tokenizer.encode(PROMPT)
    llama = httpx.post(server.url + "/tokenize", json={"content": PROMPT}).json()
    vllm = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "model": "tiny"}).json()
    assert llama["tokens"] == vllm["tokens"] == ids and vllm["count"] == len(ids) and vllm["max_model_len"] == 512
    pieces = httpx.post(server.url + "/tokenize", json={"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == PROMPT
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages))
    info = httpx.get(server.url + "/tokenizer_info").json()  # vLLM's, which lm-eval's remote tokenizer reads
    assert reference.tokenizer.encode(info["eos_token"]) == [reference.tokenizer.eos_token_id]
    assert info["chat_template"] == reference.tokenizer.chat_template
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()
    assert back["content"] == back["prompt"] == PROMPT
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"), ("/tokenize", {}, None),
                              ("/tokenize", {"content": "a", "prompt": "b"}, None)]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and (param is None or r.json()["error"]["param"] == param)


def test_cors_is_off_by_default_and_on_for_allowed_origins(server, make_server):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    assert "access-control-allow-origin" not in httpx.options(server.url + "/v1/completions", headers=preflight).headers
    cors = make_server(allowed_origins=["http://app.example"], api_key="k")
    r = httpx.options(cors.url + "/v1/completions", headers=preflight)  # no key: browsers send none here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(cors.url + "/tokenize", json={"content": "a"},
                   headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(cors.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
