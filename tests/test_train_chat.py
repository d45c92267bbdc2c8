"""The synthetic chat data (deltaserve.train_chat) and the tool calls of the model trained on it.

Rendering is checked against conversations written out by hand; generated answers against a small play
whose facts are read off by eye; every generated tool call through our own tool-call parser (the server's),
and its quoted line against the play's text. The shipped model is asked held-out questions through a live
server and the openai client, without constrained decoding.
"""

import json
import random

import pytest

from deltaserve.callforms import CallForm
from deltaserve.server.toolcalls import ARGUMENTS, CALL, ToolCallParser
from deltaserve.train import DEFAULT_DATA_DIR, HELD_OUT, SDIST_FILE, read_texts
from deltaserve.train_chat import (FIND_LINE, SYSTEM, ask_first_speaker, ask_scene_count, ask_who_says, conversations,
                                   find_line, parse_play, render)

PLAY = """\
THE TRAGEDY OF NOBODY

ACT I.

SCENE I. A heath.

[Enter two Witches.]

FIRST WITCH.
When shall we two meet again, my sister?
In thunder, lightning, or in the rain?

SECOND WITCH.
When the hurlyburly's done at last.

SCENE 2. A camp.

DUNCAN.
What bloody man is that before us now?

ACT 2

SCENE I. A court.

Banq. [Aside.]
How goes the night, boy, in this court?

THESEUS
I must confess that I have heard so much.
"""


@pytest.fixture(scope="module")
def play():
    return parse_play("nobody", PLAY)


def test_parse_play_reads_acts_scenes_and_speakers(play):
    assert play.title == "Nobody"
    assert [(s.act, s.scene, s.speaker, s.lines) for s in play.speeches] == [
        ("I", "I", "First Witch", ("When shall we two meet again, my sister?", "In thunder, lightning, or in the rain?")),
        ("I", "I", "Second Witch", ("When the hurlyburly's done at last.",)),
        ("I", "II", "Duncan", ("What bloody man is that before us now?",)),
        ("II", "I", "Banq", ("How goes the night, boy, in this court?",)),
        ("II", "I", "Theseus", ("I must confess that I have heard so much.",))]
    assert parse_play("sonnets", "SONNETS\n\nI\n\nFrom fairest creatures we desire increase,\n") is None


def test_answers_are_the_plays_facts(play):
    rng = random.Random(0)
    for _ in range(10):
        question, reasoning, answer = ask_first_speaker(play, rng)
        act = "I" if "Act I " in question or "Act I?" in question else "II"
        speaker, line = {"I": ("First Witch", "When shall we two meet again, my sister?"),
                         "II": ("Banq", "How goes the night, boy, in this court?")}[act]
        assert f"'tis {speaker} that speaks first in Act {act}, and says: \"{line}\"" in answer
        assert f"So {speaker} speaks first." in reasoning
        question, reasoning, answer = ask_scene_count(play, rng)
        assert ("Act I hath two scenes." in answer) if "Act I " in question else ("Act II hath one scene." in answer)
        question, reasoning, answer = ask_who_says(play, rng)
        said = question.split('"')[1]
        who = next(s.speaker for s in play.speeches if said in s.lines)
        assert f"'twas {who} that spake it" in answer


def test_find_line_returns_a_line_of_the_character(play):
    assert find_line(play, "first witch", random.Random(1)) in (
        "First Witch, Act I, Scene I: When shall we two meet again, my sister?",
        "First Witch, Act I, Scene I: In thunder, lightning, or in the rain?")
    assert find_line(play, "Hamlet", random.Random(1)) == "No lines of Hamlet in Nobody."


def test_a_tool_episode_renders_as_written_by_hand():
    call = {"type": "function", "function": {"name": "find_line",
                                             "arguments": {"play": "Macbeth", "character": "Lady Macbeth"}}}
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Find me a line spoken by Lady Macbeth in Macbeth."},
                {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "I need a line."},
                {"role": "tool", "content": "Lady Macbeth, Act I, Scene V: Out, damned spot!"},
                {"role": "assistant", "content": "Marry, she saith: \"Out, damned spot!\"", "reasoning_content": ""}]
    tools = "\n".join(["<tools>", json.dumps(FIND_LINE), "</tools>"])
    expected = (
        "<|im_start|>system\n# Tools\n\nThese functions are available to you:\n\n" + tools + "\n\n"
        "To call one, write exactly this and nothing after it (one <parameter> block per argument):\n\n"
        "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nvalue\n</parameter>\n</function>\n</tool_call>\n\n"
        "Give every required argument. Any explanation goes before the call. If no function helps, answer as usual."
        "\n\n" + SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\nFind me a line spoken by Lady Macbeth in Macbeth.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI need a line.\n</think>\n\n"
        "<tool_call>\n<function=find_line>\n<parameter=play>\nMacbeth\n</parameter>\n"
        "<parameter=character>\nLady Macbeth\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nLady Macbeth, Act I, Scene V: Out, damned spot!\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nMarry, she saith: \"Out, damned spot!\"<|im_end|>\n")
    assert render(messages, tools=True) == expected


def test_thinking_off_and_an_earlier_turn_lose_their_thinking():
    messages = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Banquo.", "reasoning_content": "Hm."},
                {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Macbeth.", "reasoning_content": ""}]
    assert render(messages, tools=False) == (
        "<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\nBanquo.<|im_end|>\n"
        "<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nMacbeth.<|im_end|>\n")


def test_conversations_repeat_for_a_seed(play):
    assert conversations([play], 30, 7) == conversations([play], 30, 7)
    assert conversations([play], 30, 7) != conversations([play], 30, 8)


def calls_in(text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of every call our server's parser reads out of an assistant turn."""
    parser = ToolCallParser(CallForm.XML, [FIND_LINE], new_id=lambda: "call")
    events = parser.feed(text) + parser.finish()
    names = [e[3] for e in events if e[0] == CALL]  # (CALL, index, id, name)
    arguments = "".join(e[2] for e in events if e[0] == ARGUMENTS)
    return [(names[0], json.loads(arguments))] if names else []


@pytest.fixture(scope="module")
def plays():
    sdist = DEFAULT_DATA_DIR / SDIST_FILE
    if not sdist.is_file():
        pytest.skip(f"{sdist} is not here (python -m deltaserve.train downloads it)")
    texts = read_texts(sdist)
    return texts, {name: p for name, text in texts.items() if name not in HELD_OUT and (p := parse_play(name, text))}


def test_every_generated_tool_call_parses_and_quotes_the_play(plays):
    texts, by_name = plays
    by_title = {p.title: (name, p) for name, p in by_name.items()}
    episodes = [m for m, tools in conversations(list(by_name.values()), 300, 0) if tools]
    assert len(episodes) > 100
    for messages in episodes:
        turns = render(messages, tools=True).split("<|im_start|>assistant\n")[1:]
        call_turn, answer_turn = turns[0], turns[1]
        [(name, arguments)] = calls_in(call_turn.split("</think>\n\n")[1].removesuffix("<|im_end|>\n"))
        assert name == "find_line" and set(arguments) == {"play", "character"}
        assert arguments["character"] in messages[1]["content"] and arguments["play"] in messages[1]["content"]
        play_name, play = by_title[arguments["play"]]
        where, line = messages[3]["content"].split(": ", 1)
        assert where.startswith(arguments["character"] + ", Act ")
        assert line in texts[play_name]  # a real line of the play
        assert any(line in s.lines and s.speaker == arguments["character"] for s in play.speeches)
        assert f'"{line}"' in answer_turn  # and the answer quotes it


# -- the shipped model ------------------------------------------------------------------------------------------

HELD_OUT_QUESTIONS = ["Find me a line spoken by Viola in Twelfth Night.", "Look up a line of Brutus in Julius Caesar.",
                      "Give me a line that Horatio says in Hamlet.", "Can you find what Malvolio says in Twelfth Night?",
                      "I want a quotation from Cassius in Julius Caesar."]


def test_the_shipped_model_calls_find_line_on_held_out_questions():
    """Through a live server and the openai client, tool_choice auto (no grammar): plays it never saw."""
    openai = pytest.importorskip("openai")
    from deltaserve.bench.toolcall import well_formed
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.llm import DEFAULT_MODEL, load
    from deltaserve.server.app import create_app
    from tests.server.conftest import LiveServer

    model, tokenizer = load(DEFAULT_MODEL)
    engine = Engine(model, tokenizer, n_slots=1, max_len=1024, prefill_chunk=256, model_name="default")
    live = LiveServer(create_app(engine))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=300)
        calls = []
        for question in HELD_OUT_QUESTIONS:
            reply = client.chat.completions.create(
                model="default", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                tools=[FIND_LINE], tool_choice="auto", temperature=0, max_tokens=160)
            calls.append(well_formed(reply.choices[0].message))
    finally:
        live.stop()
        engine.close()
    assert sum(c is not None for c in calls) >= 4, calls
