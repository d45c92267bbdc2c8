"""A small qwen35 model made, in the test session, to answer a few conversations with tool calls: a random
model never writes a call, so this one is fitted to. Its replies are written by hand below.

Its trunk is random (deltaserve.train's initialisation); its output head is solved for: the final hidden
states at every position of each reply, computed by the model's own inference path on the prompt the
presets' template renders for the conversation (tools, earlier calls and their results included) followed by
the reply, are fewer than their width and so linearly independent, and the least-squares head maps each to
a logit of MARGIN for the reply's next token and 0 for every other. Greedy decoding then writes each reply
exactly, but only after exactly that prompt: a server that rendered a request differently gets noise, and a
client reads the call only if the server parsed it. Seconds to make, no training loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from deltaserve.callforms import CallForm, render_call
from deltaserve.convert import write_gguf
from deltaserve.convert.presets import preset_config, train_tokenizer
from deltaserve.convert.templates import QWEN3_JSON, QWEN35
from deltaserve.train import build_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
QUESTION = "What is the weather in Paris?"
THOUGHT = "They want the weather in Paris; the tool knows it."
CALL_ARGS = {"city": "Paris", "days": 3}
RESULT = "Sunny, 18 C"
ANSWER = "It is sunny in Paris, 18 C."
CALL_ID = "call_weather_1"
MARGIN = 40.0  # logit of the reply's token over every other


def conversations(form: CallForm) -> list[tuple[list[dict], str]]:
    """(messages, the reply the model gives): a call, then an answer from the call's result. In the XML form
    (Qwen3.5's template) the prompt opens the thinking; in the JSON form (Qwen3's) the reply does."""
    call = {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}
    ask = [{"role": "user", "content": QUESTION}]
    after = ask + [{"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT}]
    opens = "" if form is CallForm.XML else "<think>\n"
    return [(ask, f"{opens}{THOUGHT}\n</think>\n\n{render_call(form, 'get_weather', CALL_ARGS)}"),
            (after, f"{opens}The tool answered.\n</think>\n\n{ANSWER}")]


def _final_states(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), hidden] final-norm outputs of `ids` through the inference path."""
    seen = []
    hook = model.norm.register_forward_hook(lambda module, args, out: seen.append(out[0].double()))
    try:
        model(torch.tensor([ids]), model.new_state(1, len(ids) + 1), [0], logits="all")
    finally:
        hook.remove()
    return seen[0]


def fitted_tool_model(out: Path, tools: list[dict], form: CallForm = CallForm.XML, seed: int = 0) -> Path:
    """Write to `out` a qwen35 GGUF that answers conversations(form) with `tools`, its template the preset
    that writes that form (QWEN35 or QWEN3_JSON)."""
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(arch="qwen35")
    tokenizer.chat_template = QWEN35 if form is CallForm.XML else QWEN3_JSON
    config = dataclasses.replace(preset_config("qwen35", "tiny256", tokenizer.vocab_size), tie_word_embeddings=False)
    model = build_model(config, seed).eval()
    states, targets = [], []
    for messages, reply in conversations(form):
        prompt = tokenizer.encode(tokenizer.chat_prompt(messages, tools=tools))
        answer = tokenizer.encode(reply) + [tokenizer.eos_token_id]  # <|im_end|> ends the turn
        states.append(_final_states(model, prompt + answer[:-1])[len(prompt) - 1:])
        targets += answer
    h = torch.cat(states)  # [n, hidden], n < hidden
    if h.shape[0] >= h.shape[1]:
        raise ValueError(f"{h.shape[0]} reply tokens do not fit a head of width {h.shape[1]}")
    wanted = torch.zeros(h.shape[0], config.vocab_size, dtype=torch.float64)
    wanted[torch.arange(h.shape[0]), torch.tensor(targets)] = MARGIN
    head = torch.linalg.lstsq(h, wanted, driver="gelsd").solution.T  # [vocab, hidden]
    with torch.no_grad():
        model.lm_head.weight.copy_(head.float())
    return write_gguf(out, config, model.state_dict(), tokenizer, "f32", name="tool-calling test model")
