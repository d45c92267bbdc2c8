"""llama-server's slot save / restore / erase: a saved slot restored into a fresh server serves a prompt that
extends it from its state (cached tokens reported, output what a cold prefill gives), and every bad file
or request is refused with one clear error while the slot keeps what it held."""

import threading

import httpx
import pytest

from deltaserve.convert import make_model
from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import load
from deltaserve.server.app import create_app

from .conftest import LiveServer

PROMPT = list(range(3, 70))  # 67 token ids


@pytest.fixture
def make_server(tiny_gguf, tmp_path):
    made = []

    def make(path=tiny_gguf, slot_save_path=tmp_path, n_slots=1):
        model, tokenizer = load(path)
        engine = Engine(model, tokenizer, n_slots=n_slots, max_len=512, prefill_chunk=32, model_name="tiny")
        server = LiveServer(create_app(engine, slot_save_path=slot_save_path))
        made.append((server, engine))
        return server

    yield make
    for server, engine in made:
        server.stop()
        engine.close()


def complete(server, prompt, **extra):
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def action(server, slot, what, filename=None):
    return httpx.post(f"{server.url}/slots/{slot}", params={"action": what},
                      json=None if filename is None else {"filename": filename}, timeout=60)


def test_save_restore_in_a_fresh_server_continues_from_the_saved_state(make_server, tmp_path):
    first = make_server()
    out = complete(first, PROMPT)
    held = httpx.get(first.url + "/slots").json()[0]["n_tokens"]
    assert held >= len(PROMPT) and not httpx.get(first.url + "/slots").json()[0]["is_processing"]
    saved = action(first, 0, "save", "conv.bin").json()
    assert saved["n_saved"] == held and saved["n_written"] == (tmp_path / "conv.bin").stat().st_size
    erased = action(first, 0, "erase").json()
    assert erased == {"id_slot": 0, "n_erased": held} and httpx.get(first.url + "/slots").json()[0]["n_tokens"] == 0

    second = make_server()
    restored = action(second, 0, "restore", "conv.bin").json()
    assert restored["n_restored"] == held and restored["n_read"] == saved["n_written"]
    follow = PROMPT + out["choices"][0]["token_ids"] + [5, 9, 11]
    warm = complete(second, follow)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    cold = complete(make_server(slot_save_path=None), follow, cache_prompt=False)
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]


def test_bad_names_and_files_get_one_clear_error_and_leave_the_slot_alone(make_server, tmp_path, tiny_gguf):
    server = make_server()
    complete(server, PROMPT)
    held = httpx.get(server.url + "/slots").json()[0]["n_tokens"]
    for name in ("../escape.bin", ".hidden", "a/b", "", "x" * 200):
        r = action(server, 0, "save", name)
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", name
    assert not (tmp_path.parent / "escape.bin").exists()
    assert action(server, 0, "restore", "missing.bin").status_code == 404
    assert action(server, 3, "save", "x.bin").json()["error"]["param"] == "id_slot"
    assert action(server, 0, "rename", "x.bin").json()["error"]["param"] == "action"

    assert action(server, 0, "save", "good.bin").status_code == 200
    data = (tmp_path / "good.bin").read_bytes()
    middle = len(data) // 2
    (tmp_path / "flipped.bin").write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:])
    (tmp_path / "truncated.bin").write_bytes(data[:middle])
    (tmp_path / "noise.bin").write_bytes(b"\x00" * 64)
    other = tmp_path / "other.gguf"
    make_model("qwen35", "tiny", "f32", other, seed=1)
    foreign = make_server(path=other)
    complete(foreign, PROMPT)
    assert action(foreign, 0, "save", "foreign.bin").status_code == 200
    for name, words in (("flipped.bin", "checksum"), ("truncated.bin", ""), ("noise.bin", ""),
                        ("foreign.bin", "another model")):
        r = action(server, 0, "restore", name)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (name, r.text)
    assert httpx.get(server.url + "/slots").json()[0]["n_tokens"] == held


def test_without_a_save_path_saving_is_off_and_a_busy_slot_is_refused(make_server):
    off = make_server(slot_save_path=None)
    r = action(off, 0, "save", "x.bin")
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]

    server = make_server()
    started = threading.Event()

    def long_request():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(60)
    r = action(server, 0, "save", "busy.bin")
    worker.join()
    assert r.status_code == 409 and r.json()["error"]["code"] == "slot_busy"


def test_props_describe_the_server_as_llama_servers_do(server, tiny_gguf):
    """GET /props: the context and slots the test engine was made with (conftest: 512 tokens, 4 slots), and the
    template and special tokens the GGUF holds (read back with gguf-py, not through our loader)."""
    import gguf

    reader = gguf.GGUFReader(tiny_gguf)

    def field(key):
        f = reader.fields[key]
        return bytes(f.parts[f.data[0]]).decode() if f.types[0] == gguf.GGUFValueType.STRING else int(f.parts[-1][0])

    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    props = httpx.get(server.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 4
    assert props["chat_template"] == field("tokenizer.chat_template")
    assert props["eos_token"] == tokens[field("tokenizer.ggml.eos_token_id")]
    assert props["model_alias"] == "tiny" and props["modalities"] == {"vision": False, "audio": False}
