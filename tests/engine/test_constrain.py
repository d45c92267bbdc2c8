"""Constrained decoding: the grammars take exactly what the chat templates write, and random-weight models of
every family, sampled under a grammar, write only output that jsonschema validates (alone, batched with
other requests, and decoding speculatively)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from gguf import TokenType
from llguidance.torch import fill_next_token_bitmask

from deltaserve.callforms import CallForm
from deltaserve.convert.presets import TOKENIZER_TEXT, train_tokenizer
from deltaserve.engine.constrain import (Constraint, apply_masks, fill_mask, fill_masks, grammar_error,
                                         grammar_tokenizer, grammar_tokenizer_ready)
from deltaserve.engine.engine import Engine
from deltaserve.engine.grammar import Tool, closed, json_grammar, tool_call_grammar
from deltaserve.engine.llm import LLM, load
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError
from deltaserve.tokenizer import train_bpe

from ..conftest import ARCHES

# Schemas whose every string, number and array is bounded, so that a random model must finish them.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 7},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "role", "active"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}},
    "shipping": {"type": "object", "properties": {"express": {"type": "boolean"},
                                                   "zone": {"type": "integer", "minimum": 1, "maximum": 5}},
                 "required": ["express"]},
    "note": {"type": ["string", "null"], "maxLength": 5}}, "required": ["id", "items", "shipping"]}
WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 9},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]})
SEARCH = Tool("search", {"type": "object", "properties": {"query": {"type": "string", "maxLength": 6},
                                                           "limit": {"type": "integer", "minimum": 1, "maximum": 3}},
                         "required": ["query"]})


def parse_call(text: str, form: CallForm) -> tuple[str, dict]:
    """(name, arguments) of one call as the templates write it, read with plain regular expressions; XML
    values typed by the tool's schema (strings as they are, anything else JSON)."""
    if form is CallForm.JSON:
        m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.S)
        call = json.loads(m.group(1))
        return call["name"], call["arguments"]
    m = re.fullmatch(r"<tool_call>\n<function=([\w-]+)>\n(.*)</function>\n</tool_call>", text, re.S)
    tool = {"get_weather": WEATHER, "search": SEARCH}[m.group(1)]
    args = {}
    for key, value in re.findall(r"<parameter=([\w-]+)>\n(.*?)\n</parameter>\n", m.group(2), re.S):
        kind = tool.parameters["properties"][key].get("type")
        args[key] = value if kind == "string" else json.loads(value)
    assert "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in args.items()) == m.group(2), text
    return m.group(1), args


# ---------------------------------------------------------------- the grammars against the templates' text

@pytest.mark.parametrize("arch, form", [("qwen35", CallForm.XML), ("qwen3next", CallForm.JSON)])
def test_tool_grammar_takes_exactly_the_calls_the_template_renders(arch, form):
    tok = train_tokenizer(arch=arch)

    def rendered(name: str, arguments: dict) -> str:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]}],
                                       add_generation_prompt=False)
        reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        return reply.split("</think>\n\n")[-1]  # a template may write an empty thinking block first

    first = rendered("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"})
    # parallel calls: one per line, as Qwen3.5's own template writes them
    both = first + "\n" + rendered("search", {"query": "rain"})
    grammar = tool_call_grammar([WEATHER, SEARCH], form)
    assert grammar_error(grammar, tok, tok.vocab_size) is None
    c = Constraint(grammar, tok, tok.vocab_size)
    assert all(c.take(t) is False for t in tok.encode(both))  # a third call may still follow ...
    assert c.matcher.is_accepting()  # ... or the output may end
    one = Constraint(tool_call_grammar([WEATHER, SEARCH], form, parallel=False), tok, tok.vocab_size)
    assert [one.take(t) for t in tok.encode(first)][-1]  # one call, and nothing may follow it
    bad = tok.encode(first.replace("celsius", "kelvin"))  # not in the enum
    assert Constraint(grammar, tok, tok.vocab_size).matcher.validate_tokens(bad) < len(bad)
    missing = tok.encode(rendered("get_weather", {"days": 3, "unit": "celsius"}))  # city is required
    assert Constraint(grammar, tok, tok.vocab_size).matcher.validate_tokens(missing) < len(missing)


def test_thinking_comes_before_the_answer():
    tok = train_tokenizer(arch="qwen35")
    answer = '{"name": "Ann", "age": 31, "role": "user", "active": true}'
    think = Constraint(json_grammar(PERSON, thinking=True), tok, tok.vocab_size)
    ids = tok.encode("Let me see.\n</think>\n\n" + answer)
    assert [think.take(t) for t in ids][-1]
    plain = Constraint(json_grammar(PERSON), tok, tok.vocab_size)
    assert plain.matcher.validate_tokens(ids) == 0  # without thinking, the answer is all there is
    unfinished = Constraint(json_grammar(PERSON, thinking=True), tok, tok.vocab_size)
    assert not any(unfinished.take(t) for t in tok.encode(answer))  # still thinking: no answer yet
    assert not unfinished.matcher.is_accepting()


def test_call_markers_stay_one_token_where_the_vocabulary_makes_them_control_tokens():
    """A converter may type <tool_call> as a control token (transformers' tiktoken converter does for
    Qwen3.5's); the grammar must still let the model write it as the one token it was trained on, while a
    control token that is no literal of the grammar stays out."""
    tok = train_bpe(TOKENIZER_TEXT.split("\n\n"), 600, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                     "<tool_call>", "</tool_call>"))
    call = tok.encode("<tool_call>")
    assert len(call) == 1 and tok.token_types[call[0]] == TokenType.CONTROL
    c = Constraint(tool_call_grammar([SEARCH], CallForm.JSON, parallel=False), tok, tok.vocab_size)
    words = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    fill_next_token_bitmask(c.matcher, words, 0)
    assert (int(words[0, call[0] // 32]) >> (call[0] % 32)) & 1
    end = tok.encode("<|im_end|>")[0]  # a control token that is no marker: never text
    assert not (int(words[0, end // 32]) >> (end % 32)) & 1


def test_our_mask_fill_is_llguidances(tmp_path):
    """fill_mask / fill_masks (llguidance's pointer API, without importing llguidance.torch) write the bitmask
    llguidance's own torch wrapper writes, row by row and in a batch; a wrongly laid buffer is refused."""
    tok = train_tokenizer(arch="qwen35")
    words_of = lambda n: torch.zeros(n, (tok.vocab_size + 31) // 32, dtype=torch.int32)  # noqa: E731
    a = Constraint(json_grammar(PERSON), tok, tok.vocab_size)
    b = Constraint(json_grammar(PERSON), tok, tok.vocab_size)
    for t in tok.encode('{"name": "A'):
        b.take(t)
    want = words_of(2)
    fill_next_token_bitmask(a.matcher, want, 0)
    fill_next_token_bitmask(b.matcher, want, 1)
    assert not torch.equal(want[0], want[1])  # two different states of the grammar
    one, both = words_of(2), words_of(2)
    fill_mask(a.matcher, one, 0)
    fill_mask(b.matcher, one, 1)
    fill_masks([(b.matcher, 1), (a.matcher, 0)], both)
    assert torch.equal(one, want) and torch.equal(both, want)
    with pytest.raises(ValueError, match="contiguous int32"):
        fill_mask(a.matcher, words_of(2).t().contiguous().t(), 0)
    with pytest.raises(ValueError, match="contiguous int32"):
        fill_masks([(a.matcher, 2)], words_of(2))


def test_mask_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(3)
    V = 1003  # not a multiple of 32
    words = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), generator=gen, dtype=torch.int32)
    logits = torch.randn(3, V, generator=gen)
    expect = logits.clone().double()
    for r in range(3):
        for t in range(V):
            if not (int(words[r, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1:
                expect[r, t] = float("-inf")
    strided = logits.t().contiguous().t()  # the torch path (the numpy one takes contiguous CPU rows)
    apply_masks(logits, words)
    apply_masks(strided, words)
    assert torch.equal(logits.double(), expect) and torch.equal(strided.double(), expect)


def test_objects_are_closed_where_the_schema_leaves_them_open():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"e": {"properties": {}, "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["$defs"]["e"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_a_grammar_that_does_not_compile_fails_its_request_alone():
    llm = LLM(None, max_len=256)
    with pytest.raises(DeltaserveError, match="grammar"):
        llm.generate("ROMEO:", max_tokens=5, grammar=json_grammar({"type": "object", "properties": {
            "a": {"$ref": "#/nowhere"}}}))
    assert llm.generate("ROMEO:", max_tokens=5, temperature=0).finish_reason == "length"


# ---------------------------------------------------------------- random models of every family

def _prompt(tok, schema_name: str) -> list[int]:
    messages = [{"role": "user", "content": f"Reply with a {schema_name} as JSON."}]
    return tok.encode(tok.apply_chat_template(messages, enable_thinking=False))


@pytest.mark.parametrize("arch", ARCHES)
def test_every_constrained_output_of_a_random_model_validates(arch, model_path):
    llm = LLM(model_path(arch), max_len=1024)
    tok, finished = llm.tokenizer, 0
    form = CallForm.JSON if arch == "qwen3next" else CallForm.XML
    cases = [("person", json_grammar(PERSON), PERSON), ("order", json_grammar(ORDER), ORDER),
             ("object", json_grammar(), {"type": "object"}),
             ("call", tool_call_grammar([WEATHER, SEARCH], form, parallel=False), None)]
    for name, grammar, schema in cases:
        for seed in range(3):
            out = llm.generate(_prompt(tok, name), max_tokens=400, temperature=1.0, seed=seed, grammar=grammar)
            if out.finish_reason == "length" and schema == {"type": "object"}:
                continue  # an open object may go on for ever; what was written must still be a prefix
            assert out.finish_reason == "stop", (arch, name, seed, out.text)
            finished += 1
            if schema is None:
                fn, args = parse_call(out.text, form)
                jsonschema.validate(args, {"get_weather": WEATHER, "search": SEARCH}[fn].parameters)
            else:
                jsonschema.validate(json.loads(out.text), schema)
    assert finished >= 9 + 1


# ---------------------------------------------------------------- batching and speculative decoding

def _submit(engine: Engine, ids: list[int], params: SamplingParams):
    done, finished = [], threading.Event()

    def on_event(event):
        if getattr(event, "reason", None):
            done.append(event)
            finished.set()

    engine.submit(ids, params, on_event)
    return lambda: (finished.wait(300), done[0])[1]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_batched_constrained_requests_leave_their_neighbours_unchanged(embedded, speculative):
    model, tok = embedded
    prompts = [tok.encode(p) for p in ("ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nWe are")]
    greedy = dict(max_tokens=40, temperature=0.0)
    solo_engine = Engine(model, tok, n_slots=1, max_len=256)
    try:
        alone = [_submit(solo_engine, ids, SamplingParams(**greedy))().token_ids for ids in prompts[:2]]
    finally:
        solo_engine.close()
    engine = Engine(model, tok, n_slots=5, max_len=256, speculative=speculative)
    try:
        waits = [_submit(engine, ids, SamplingParams(**greedy)) for ids in prompts[:2]]
        constrained = [_submit(engine, prompts[2], SamplingParams(max_tokens=200, temperature=1.0, seed=s,
                                                                   grammar=json_grammar(schema)))
                       for s, schema in enumerate((PERSON, ORDER, PERSON))]
        assert [w().token_ids for w in waits] == alone
        for wait, schema in zip(constrained, (PERSON, ORDER, PERSON)):
            done = wait()
            assert done.reason == "stop", done.text
            jsonschema.validate(json.loads(done.text), schema)
    finally:
        engine.close()


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_speculative_decoding_under_a_grammar_gives_plain_decodings_tokens(drafter):
    """Greedy speculative decoding gives the tokens of plain decoding, also under a grammar: the drafts are
    checked against it, and the matcher returns with the rolled-back state. A prompt that repeats itself
    makes the ngram drafter propose, some drafts the grammar refuses; the embedded model's own MTP layer
    drafts whatever its training makes likely, which the grammar refuses often."""
    llm = LLM(None, max_len=512)
    tok = llm.tokenizer
    prompt = tok.encode('{"name": "ROMEO", "age": 16, "role": "user", "active": true}\n' * 3)
    for schema in (PERSON, ORDER):
        grammar = json_grammar(schema)
        plain = llm.generate(prompt, max_tokens=150, temperature=0, grammar=grammar, speculative=False)
        spec = llm.generate(prompt, max_tokens=150, temperature=0, grammar=grammar, speculative=drafter)
        assert spec.token_ids == plain.token_ids and plain.finish_reason == "stop"
        jsonschema.validate(json.loads(spec.text), schema)
        sampled = llm.generate(prompt, max_tokens=150, temperature=1.0, seed=4, grammar=grammar,
                               speculative=drafter)
        jsonschema.validate(json.loads(sampled.text), schema)
    stats = llm.speculators[drafter]
    assert stats.proposed > 0 and stats.accepted > 0  # drafting happened, and some drafts were kept


def test_the_engine_builds_the_grammar_tokenizer_when_it_loads(tiny_gguf):
    """The vocabulary's tables for llguidance are built beside a new engine, not by its first constrained
    request: ready after a bounded wait with no request made, and that very build is what the request uses."""
    model, tok = load(tiny_gguf)  # a tokenizer of its own: nothing was built for it yet
    assert not grammar_tokenizer_ready(tok, model.config.vocab_size)
    engine = Engine(model, tok, n_slots=1, max_len=256)
    try:
        assert engine.grammar_ready(timeout=60)
        built = grammar_tokenizer(tok, model.config.vocab_size)
        done = _submit(engine, tok.encode("ROMEO:"), SamplingParams(max_tokens=100, temperature=1.0, seed=1,
                                                                     grammar=json_grammar(PERSON)))()
        jsonschema.validate(json.loads(done.text), PERSON)
        assert grammar_tokenizer(tok, model.config.vocab_size) is built
    finally:
        engine.close()
