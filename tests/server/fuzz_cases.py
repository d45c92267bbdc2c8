"""Cases of the request fuzzer (test_fuzz.py): seeded, per class, each with the status the API's rules give
it, written from the API's documented rules (OpenAI's types and ranges, this server's bounds), not from
its code."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from deltaserve.convert.presets import train_tokenizer

LIMIT = 4 * 2**20  # the default --max-request-bytes
VOCAB = train_tokenizer().vocab_size  # the tiny test model's (make_model sizes it to its tokenizer)
CONTEXT = 512  # as the session's engine serves it
PROMPTS = ["To be, or not to be", "Hello there", "ROMEO:", "A tale of two cities"]
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


@dataclass
class Case:
    kind: str
    path: str
    content: bytes
    expect: set[int]
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    stream: bool = False
    label: str = ""


def _int(v) -> bool:
    return type(v) is int


def _num(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _stops_ok(v) -> bool:
    stops = [v] if isinstance(v, str) else v
    return isinstance(stops, list) and len(stops) <= 16 and all(isinstance(s, str) and 1 <= len(s) <= 1000
                                                                 for s in stops)


def _text_ok(v) -> bool:
    try:
        v.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# field -> whether a value is valid for it (None: the default, as in OpenAI's API)
RULES = {
    "max_tokens": lambda v: _int(v) and 0 <= v <= 256,  # the pools hold no value between 256 and the room
    "max_completion_tokens": lambda v: _int(v) and 0 <= v <= 256,
    "temperature": lambda v: _num(v) and 0 <= v <= 2,
    "top_p": lambda v: _num(v) and 0 < v <= 1,
    "top_k": lambda v: _int(v) and v >= 0,
    "min_p": lambda v: _num(v) and 0 <= v <= 1,
    "seed": lambda v: _int(v) and SEED_MIN <= v <= SEED_MAX,
    "n": lambda v: _int(v) and v == 1,
    "stream": lambda v: type(v) is bool,
    "return_token_ids": lambda v: type(v) is bool,
    "ignore_eos": lambda v: type(v) is bool,
    "stream_options": lambda v: isinstance(v, dict) and v.get("include_usage") in (None, True, False),
    "stop": _stops_ok,
}


def expected(path: str, body) -> int:
    """The status the API's rules give `body` (a parsed JSON value)."""
    if not isinstance(body, dict):
        return 400
    chat = path.endswith("/chat/completions")
    for name, ok in RULES.items():
        if name == "max_completion_tokens" and not chat:  # a field completions do not have: ignored
            continue
        if body.get(name) is not None and not ok(body[name]):
            return 400
    if chat:
        status = _messages_status(body.get("messages"))
    else:
        status = _prompt_status(body.get("prompt"), body)
    if status != 200:
        return status
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return 400
    return 404 if model not in (None, "", "tiny") else 200


def _prompt_status(prompt, body) -> int:
    if isinstance(prompt, str):
        return 200 if prompt and _text_ok(prompt) and len(prompt) < 2000 else 400
    if isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        return 200 if all(0 <= t < VOCAB for t in prompt) and len(prompt) + body.get("max_tokens", 16) < CONTEXT \
            else 400
    return 400


def _messages_status(messages) -> int:
    if not isinstance(messages, list) or not 1 <= len(messages) <= 4096:
        return 400
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            return 400
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and _text_ok(p["text"]) for p in content):
                return 400
        elif content is not None and not (isinstance(content, str) and _text_ok(content)):
            return 400
    return 200


class Generator:
    """Seeded cases of each class."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def base(self, chat: bool | None = None) -> tuple[str, dict]:
        """A small valid request (a few tokens)."""
        rng = self.rng
        chat = rng.random() < 0.5 if chat is None else chat
        body = {"max_tokens": rng.randint(1, 4)}
        if rng.random() < 0.3:
            body["stream"] = True
        if chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}

    def case(self, kind: str, path: str, body, label: str = "", raw: bytes | None = None,
             expect: set[int] | None = None) -> Case:
        content = raw if raw is not None else json.dumps(body).encode()
        if expect is None:  # judged as the server reads it: "\ud83d\ude00" in JSON is one character
            expect = {413} if len(content) > LIMIT else {expected(path, json.loads(content))}
        stream = isinstance(body, dict) and body.get("stream") is True
        return Case(kind, path, content, expect, stream=stream, label=label)

    # ------------------------------------------------------------------ classes
    def malformed_json(self, n: int) -> list[Case]:
        rng, out = self.rng, []
        fixed = [b"", b"{", b"}", b"[", b"null", b"true", b"1", b'"x"', b"[]", b"{}", b'{"prompt": "x",}',
                 b'{"prompt": "\xff\xfe"}', b'{"prompt": "x"}}', b'{"prompt": "x", "temperature": NaN}',
                 b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": -Infinity}',
                 b'{"prompt": "x", "temperature": 1e999}', b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
                 b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", b"\x00" * 100,
                 b'{"prompt": "unterminated', b"{'prompt': 'single quotes'}"]
        for raw in fixed:
            out.append(self.case("malformed_json", "/v1/completions", None, "fixed", raw=raw, expect={400}))
        plain = self.case("malformed_json", "/v1/completions", None, "text/plain", raw=b'{"prompt": "x"}',
                          expect={400})
        plain.headers = {"content-type": "text/plain"}
        out.append(plain)
        while len(out) < n:
            path, body = self.base()
            text = json.dumps(body).encode()
            if rng.random() < 0.5:
                raw = text[:rng.randrange(len(text))]
            else:
                raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            try:
                parsed = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                out.append(self.case("malformed_json", path, None, "cut or random", raw=raw, expect={400}))
                continue
            out.append(self.case("malformed_json", path, parsed, "cut but parses", raw=raw))
        return out[:n]

    def wrong_types(self, n: int) -> list[Case]:
        rng, out = self.rng, []
        values = [None, True, False, "str", "", "1", "0.5", [], {}, [1, "a"], ["x"], {"a": 1}, 1.5, -1, 0, 3, 1.0]
        for _ in range(n):
            path, body = self.base()
            chat = "chat" in path
            names = [*RULES, "model", "messages" if chat else "prompt"]
            if chat:
                names += ["role", "content"]
            name, value = rng.choice(names), rng.choice(values)
            if name in ("role", "content"):
                body["messages"][0][name] = value
            else:
                body[name] = value
            out.append(self.case("wrong_types", path, body, f"{name}={value!r}"))
        return out

    def extreme_numbers(self, n: int) -> list[Case]:
        rng, out = self.rng, []
        values = [1e-40, 5e-324, -5e-324, 1e-320, 1e308, -1e308, 1.7976931348623157e308, 0.0, -0.0, 1e-7,
                  0.999999999, 1.0000001, 2.0000001, 2**31, 2**53 + 1, 2**63, 2**63 - 1, 2**64 - 1, 2**64, -2**63,
                  -2**63 - 1, 10**30, -10**30, 10**300, "nan", "NaN", "inf", "-inf", "Infinity", "1e-40", -1, 0, 1]
        numeric = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n"]
        for _ in range(n):
            path, body = self.base()
            name, value = rng.choice(numeric), rng.choice(values)
            body[name] = value
            if rng.random() < 0.3:  # two extremes at once
                body[rng.choice(numeric)] = rng.choice(values)
            out.append(self.case("extreme_numbers", path, body, f"{name}={value!r}"))
        return out

    def huge_bodies(self) -> list[Case]:
        out = []
        for size in (LIMIT - 200, LIMIT + 1, 2 * LIMIT, 10 * 2**20):
            body = {"prompt": "w" * size, "max_tokens": 1}
            out.append(self.case("huge_bodies", "/v1/completions", body, f"prompt of {size} chars"))
        ids = {"prompt": [5] * 400_000, "max_tokens": 1}
        many = {"messages": [{"role": "user", "content": "hi"}] * 60_000, "max_tokens": 1}
        stops = {"prompt": "x", "max_tokens": 1, "stop": ["ab"] * 100_000}
        padded = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        out += [self.case("huge_bodies", "/v1/completions", ids, "400k token ids"),
                self.case("huge_bodies", "/v1/chat/completions", many, "60k messages", expect={400}),
                self.case("huge_bodies", "/v1/completions", stops, "100k stop strings"),
                self.case("huge_bodies", "/v1/completions", None, "padded to the limit",
                          raw=padded + b" " * (LIMIT - len(padded)), expect={200}),
                self.case("huge_bodies", "/v1/completions", None, "padded past the limit",
                          raw=padded + b" " * (LIMIT + 1 - len(padded)), expect={413})]
        return out

    def odd_unicode(self, n: int) -> list[Case]:
        rng, out = self.rng, []
        pieces = ["\ud800", "\udfff", "\udc00\ud800", "\ud83d", "\ude00", "\x00", "\u200b\u200d", "\u202e",
                  "\U0001f469\u200d\U0001f469\u200d\U0001f467", "e" + "\u0301" * 30, "\uffff", "\ufffe", "\ue000",
                  "\U0010ffff", "<|im_start|>", "<|endoftext|>", "<|im_end|>", "\ufeff", "\r", "\x7f", "\x85",
                  "\u0645\u0631\u062d\u0628\u0627", "\u4e16\u754c", "\U0001d54f", "\ud83d\ude00"]
        for _ in range(n):
            path, body = self.base()
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
            where = rng.choice(["text", "text", "stop", "model", "role", "key"])
            if where == "text" and "chat" in path:
                body["messages"][0]["content"] = text if rng.random() < 0.5 else [{"type": "text", "text": text}]
            elif where == "text":
                body["prompt"] = text
            elif where == "key":
                body[text] = 1  # an unknown field: ignored
            elif where == "role" and "chat" in path:
                body["messages"][0]["role"] = text
            else:
                body[where if where != "role" else "model"] = text
            out.append(self.case("odd_unicode", path, body, f"{where}={text[:20]!r}"))
        return out

    def long_stop_lists(self, n: int) -> list[Case]:
        rng, out = self.rng, []
        for _ in range(n):
            path, body = self.base()
            count, length = rng.choice([0, 1, 4, 15, 16, 17, 100, 1000]), rng.choice([0, 1, 10, 999, 1000, 1001, 5000])
            body["stop"] = ["".join(rng.choice("ab \n") for _ in range(length)) for _ in range(count)]
            if rng.random() < 0.2 and count == 1:
                body["stop"] = body["stop"][0]
            out.append(self.case("long_stop_lists", path, body, f"{count} x {length}"))
        return out
