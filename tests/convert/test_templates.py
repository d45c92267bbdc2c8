"""The presets' chat templates: what they render, by hand, and the same text from transformers' own
template engine on the Hugging Face copy; a later turn leaves the prompt where the assistant's turn starts."""

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
SYSTEM = ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more of these functions to help with the "
          'request:\n<tools>\n{"name": "find_line", "description": "A character\'s line.", "parameters": {"type": '
          '"object", "properties": {"play": {"type": "string"}}}}\n</tools>\n\nTo call a function, reply with\n')
REST = ("<|im_end|>\n<|im_start|>user\nWhere is Romeo?<|im_end|>\n<|im_start|>assistant\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nBut soft!\n</tool_response>\n<tool_response>\nWhat light?\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\nHe says: But soft!<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n")
XML = ("<tool_call>\n<function=find_line>\n<parameter=play>\nromeo\n</parameter>\n<parameter=character>\nROMEO\n"
       "</parameter>\n</function>\n</tool_call>")
JSON = '<tool_call>\n{"name": "find_line", "arguments": {"play": "romeo", "character": "ROMEO"}}\n</tool_call>'
EXPECTED = {
    "qwen35": SYSTEM + "<tool_call>\n<function=NAME>\n<parameter=PARAMETER>\nvalue\n</parameter>\n</function>\n"
                       "</tool_call>" + REST.format(call=XML),
    "qwen3next": SYSTEM + '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>' + REST.format(call=JSON),
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
