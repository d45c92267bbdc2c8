"""The presets' chat templates: what they render, by hand, and the same text from transformers' own
template engine on the Hugging Face copy; a later turn leaves the prompt where the assistant's turn starts."""

from pathlib import Path

import pytest

from deltaserve.convert import make_model
from deltaserve.convert.presets import train_tokenizer

TOOLS = [{"type": "function", "function": {"name": "find_line", "description": "A character's line.",
                                           "parameters": {"type": "object", "properties": {"play": {"type": "string"}}}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is Romeo?"},
    {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\n",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "find_line", "arguments": {"play": "romeo", "character": "ROMEO"}}}]},
    {"role": "tool", "content": "But soft!"},
    {"role": "tool", "content": "What light?"},
    {"role": "assistant", "content": "He says: But soft!"},
    {"role": "user", "content": "Thanks"},
]
TOOL_LINE = ('{"type": "function", "function": {"name": "find_line", "description": "A character\'s line.", '
             '"parameters": {"type": "object", "properties": {"play": {"type": "string"}}}}}')
SYSTEM = {
    "qwen35": "<|im_start|>system\n# Tools\n\nThese functions are available to you:\n\n<tools>\n" + TOOL_LINE
              + "\n</tools>\n\nTo call one, write exactly this and nothing after it (one <parameter> block per "
              "argument):\n\n<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nvalue\n</parameter>\n</function>\n"
              "</tool_call>\n\nGive every required argument. Any explanation goes before the call. If no function "
              "helps, answer as usual.\n\nBe brief.<|im_end|>\n",
    "qwen3next": "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call functions to help with the user's request. "
                 "Their signatures, inside <tools></tools>:\n<tools>\n" + TOOL_LINE + "\n</tools>\n\nTo call one, "
                 "write a JSON object with its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n',
}
REST = ("<|im_start|>user\nWhere is Romeo?<|im_end|>\n<|im_start|>assistant\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nBut soft!\n</tool_response>\n<tool_response>\nWhat light?\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\nHe says: But soft!<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
XML = ("<tool_call>\n<function=find_line>\n<parameter=play>\nromeo\n</parameter>\n<parameter=character>\nROMEO\n"
       "</parameter>\n</function>\n</tool_call>")
JSON = '<tool_call>\n{"name": "find_line", "arguments": {"play": "romeo", "character": "ROMEO"}}\n</tool_call>'
EXPECTED = {  # Qwen3.5's generation prompt opens the thinking; Qwen3's leaves that to the model
    "qwen35": SYSTEM["qwen35"] + REST.format(call=XML) + "<think>\n",
    "qwen3next": SYSTEM["qwen3next"] + REST.format(call=JSON),
}


@pytest.mark.parametrize("arch", EXPECTED)
def test_tools_calls_and_results_render_as_written(arch):
    assert train_tokenizer(arch=arch).apply_chat_template(HISTORY, tools=TOOLS) == EXPECTED[arch]


def test_thinking_can_be_switched_off():
    tok = train_tokenizer(arch="qwen35")
    assert tok.apply_chat_template(HISTORY[:2], enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhere is Romeo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_tokens_are_whole_tokens_kept_in_text():
    tok = train_tokenizer(arch="qwen35")
    ids = tok.encode("<think>\nhmm\n</think>")
    assert tok.decode(ids[:1]) == "<think>" and tok.decode(ids, skip_special_tokens=True) == "<think>\nhmm\n</think>"


@pytest.mark.parametrize("arch", EXPECTED)
def test_transformers_renders_the_same(arch, tmp_path):
    transformers = pytest.importorskip("transformers")
    made = make_model(arch, "tiny", "f32", tmp_path / "m.gguf", hf_dir=tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(made.hf_dir)
    assert theirs.apply_chat_template(HISTORY, tools=TOOLS, tokenize=False, add_generation_prompt=True) == EXPECTED[arch]
    ids = made.tokenizer.encode(EXPECTED[arch])
    assert theirs(EXPECTED[arch], add_special_tokens=False)["input_ids"] == ids


# -- the same conversations through the real templates --------------------------------------------------------

REAL = Path(__file__).with_name("real_templates")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


def call(name, arguments, id="c"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "one question": ([{"role": "user", "content": "Hi"}], {}),
    "system and question": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    "thinking off": ([{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
    "no generation prompt": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                             {"add_generation_prompt": False}),
    "tools, no system": ([{"role": "user", "content": "Weather in Oslo?"}], {"tools": [WEATHER, TOOLS[0]]}),
    "tools and system": (HISTORY[:2], {"tools": [WEATHER]}),
    "a whole tool round": (HISTORY, {"tools": TOOLS}),
    "calls after the query keep their thinking": (
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "", "reasoning_content": "\nNeed Oslo and Rome.\n",
          "tool_calls": [call("get_weather", {"city": "Oslo", "days": 2}),
                         call("get_weather", {"city": "Rome", "days": [1, 2], "extra": {"a": True}})]},
         {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
         {"role": "assistant", "content": "Oslo is sunny, Rome wet."}], {"tools": [WEATHER]}),
    "earlier turns lose their thinking": (
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nB."},
         {"role": "user", "content": "  C?  "},
         {"role": "assistant", "content": "Let me call.", "tool_calls": [call("get_weather", {"city": "X"})]},
         {"role": "tool", "content": " r "}], {"tools": [WEATHER]}),
    "results handed back as a user turn": (
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "x"},
         {"role": "user", "content": "<tool_response>\nr\n</tool_response>"}], {}),
}


def real_render(name: str, messages: list[dict], options: dict) -> str:
    """The real template rendered by transformers' own template engine."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    options = {"add_generation_prompt": True, **options}
    rendered, _ = render_jinja_template([messages], chat_template=(REAL / name).read_text(), **options)
    return rendered[0]


def tools_block(text: str) -> str:
    return text[text.index("<tools>"):text.index("</tools>") + len("</tools>")]


@pytest.mark.parametrize("arch, real", [("qwen35", "Qwen3.5-4B.jinja"), ("qwen3next", "Qwen-Qwen3-0.6B.jinja")])
@pytest.mark.parametrize("case", CONVERSATIONS)
def test_presets_render_like_the_real_templates(arch, real, case):
    """Equal text, but for the tools block's wording (its own): there the tools listed and the system
    message are the same and in the same place."""
    messages, options = CONVERSATIONS[case]
    theirs = real_render(real, messages, options)
    tok = train_tokenizer(arch=arch)
    ours = tok.apply_chat_template(messages, **{"add_generation_prompt": True, **options})
    tok.chat_template = (REAL / real).read_text()  # the real one through our sandbox: as transformers renders it
    assert tok.apply_chat_template(messages, **{"add_generation_prompt": True, **options}) == theirs
    if "tools" not in options:
        assert ours == theirs
        return
    our_system, _, our_rest = ours.partition("<|im_end|>\n")
    their_system, _, their_rest = theirs.partition("<|im_end|>\n")
    assert our_rest == their_rest
    assert tools_block(our_system) == tools_block(their_system)
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    if system and arch == "qwen35":
        assert our_system.endswith("\n\n" + system) and their_system.endswith("\n\n" + system)
    elif system:
        assert our_system.startswith(f"<|im_start|>system\n{system}\n\n# Tools") and their_system.startswith(
            f"<|im_start|>system\n{system}\n\n# Tools")


def _llama_server() -> str | None:
    import shutil
    import sys

    found = shutil.which("llama-server") or str(Path(sys.executable).with_name("llama-server"))
    return found if Path(found).exists() else None


@pytest.mark.skipif(_llama_server() is None, reason="llama-server is not installed (scripts/install-llama-cpp.sh server)")
@pytest.mark.parametrize("arch", EXPECTED)
def test_llama_servers_template_engine_renders_the_same_text(arch, tmp_path):
    """The presets' files run in llama.cpp too: its own Jinja engine (not Python's jinja2) parses the template
    and renders the conversation as written above."""
    import json
    import socket
    import subprocess
    import time

    import httpx

    path = tmp_path / "m.gguf"
    make_model(arch, "tiny", "f16", path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([_llama_server(), "-m", str(path), "-c", "512", "--jinja", "-t", "1", "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "llama-server did not start"
            time.sleep(0.3)
        history = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
                                       for c in m["tool_calls"]]) if "tool_calls" in m else m for m in HISTORY]
        reply = httpx.post(url + "/apply-template", json={"messages": history, "tools": TOOLS}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt"] == EXPECTED[arch]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
