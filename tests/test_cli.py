"""The deltaserve command, run as a user runs it: a subprocess, its stdout and exit code."""

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltaserve.cli import build_parser
from deltaserve.engine.llm import LLM
from deltaserve import convert
from deltaserve.convert import presets

COMMANDS = ["run", "chat", "serve", "bench", "make-model"]
HEAVY = {"torch", "numpy", "gguf", "tokenizers", "jinja2", "fastapi", "uvicorn"}


def deltaserve(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "deltaserve.cli", *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=timeout, env={"DELTASERVE_NO_PROGRESS": "1", "PATH": ""})


def test_run_streams_the_same_text_as_the_api(tiny_gguf):
    done = deltaserve("run", tiny_gguf, "-p", "Hello there", "-n", "12", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    expected = LLM(tiny_gguf).generate("Hello there", max_tokens=12, temperature=0, token_healing=True)
    assert done.stdout == "Hello there" + expected.text + "\n"
    kept = deltaserve("run", tiny_gguf, "-p", "Hello there", "-n", "12", "--temperature", "0", "--no-token-healing")
    assert kept.stdout == "Hello there" + LLM(tiny_gguf).generate("Hello there", max_tokens=12, temperature=0).text + "\n"


def test_run_reads_the_prompt_from_a_file_or_standard_input(tiny_gguf, tmp_path):
    args = ["-n", "12", "--temperature", "0"]
    expected = deltaserve("run", tiny_gguf, "-p", "Hello there", *args).stdout
    (tmp_path / "prompt.txt").write_text("Hello there", encoding="utf-8")
    assert deltaserve("run", tiny_gguf, "-f", tmp_path / "prompt.txt", *args).stdout == expected
    assert deltaserve("run", tiny_gguf, "-f", "-", *args, stdin="Hello there").stdout == expected
    both = deltaserve("run", tiny_gguf, "-p", "x", "-f", "y")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    for path, why in ((tmp_path / "missing.txt", "No such file"), (tmp_path, "Is a directory")):
        done = deltaserve("run", tiny_gguf, "-f", path)
        assert done.returncode == 1 and done.stderr.startswith(f"deltaserve: error: cannot read the prompt file {path}: "
                                                               f"{why}") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("flag, name", [("--repeat-penalty", "repetition_penalty"),
                                        ("--presence-penalty", "presence_penalty"),
                                        ("--frequency-penalty", "frequency_penalty")])
def test_penalty_flags_reach_the_sampler(tiny_gguf, flag, name):
    """Greedy, the tiny model repeats a token within 40: each penalty changes the text from there (what a penalty
    does to the logits is tested against hand-computed values in engine/test_logits.py)."""
    llm = LLM(tiny_gguf)
    plain = llm.generate("Hello there", max_tokens=40, temperature=0, token_healing=True)
    expected = llm.generate("Hello there", max_tokens=40, temperature=0, token_healing=True, **{name: 1.5})
    assert expected.token_ids != plain.token_ids
    done = deltaserve("run", tiny_gguf, "-p", "Hello there", "-n", "40", "--temperature", "0", flag, "1.5")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Hello there" + expected.text + "\n"


def test_logit_bias_and_ignore_eos(tiny_gguf):
    """A bias of +100 on the end-of-text token makes it the first token: the run ends at once, or with
    --ignore-eos writes it until -n. An id outside the vocabulary is one clear line."""
    tokenizer = LLM(tiny_gguf).tokenizer
    eos = min(tokenizer.eos_token_ids)
    args = ["run", tiny_gguf, "-p", "Hello there", "-n", "5", "--temperature", "0", "-l", f"{eos}+100",
            "--no-token-healing"]  # (healing would hold the first token to ones extending the prompt's last)
    assert deltaserve(*args).stdout == "Hello there\n"
    assert deltaserve(*args, "--ignore-eos").stdout == "Hello there" + tokenizer.decode([eos]) * 5 + "\n"
    outside = deltaserve("run", tiny_gguf, "-p", "x", "-l", "100000+1")
    assert outside.returncode == 1 and "--logit-bias: token ids must be in [0, " in outside.stderr


def test_run_follows_a_json_schema(tiny_gguf, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema), encoding="utf-8")
    done = deltaserve("run", tiny_gguf, "-p", "Answer: ", "-n", "40", "--temperature", "0", "-j", f"@{tmp_path}/schema.json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.removeprefix("Answer: "))
    assert list(answer) == ["ok"] and isinstance(answer["ok"], bool)
    for bad, message in (("{bad", "--json-schema is not JSON: "), ("[1]", "--json-schema must be a JSON object")):
        refused = deltaserve("run", tiny_gguf, "-p", "x", "-j", bad)
        assert refused.returncode == 1 and refused.stderr.startswith(f"deltaserve: error: {message}")


def test_kv_dtype_option(tiny_gguf):
    """--kv-dtype runs with that cache (what it changes is tested through the API in test_kv_dtype.py);
    an unknown dtype is refused by name."""
    done = deltaserve("run", tiny_gguf, "-p", "Hello there", "-n", "12", "--temperature", "0", "--kv-dtype", "float32")
    assert done.returncode == 0, done.stderr
    expected = LLM(tiny_gguf, kv_dtype=torch.float32).generate("Hello there", max_tokens=12, temperature=0,
                                                               token_healing=True)
    assert done.stdout == "Hello there" + expected.text + "\n"
    bad = deltaserve("run", tiny_gguf, "--kv-dtype", "int3")
    assert bad.returncode != 0 and "--kv-dtype" in bad.stderr


def test_chat_answers_each_line_until_an_empty_one(tiny_gguf):
    done = deltaserve("chat", tiny_gguf, "-n", "6", "--temperature", "0", "--no-think", stdin="Hi!\nAnd again?\n\n")
    assert done.returncode == 0, done.stderr
    llm = LLM(tiny_gguf)
    history = [{"role": "user", "content": "Hi!"}]
    replies = []
    for line in ("Hi!", "And again?"):
        if replies:
            history += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": line}]
        prompt = llm.tokenizer.apply_chat_template(history, enable_thinking=False)
        replies.append(llm.generate(prompt, max_tokens=6, temperature=0).text)
    assert done.stdout == replies[0] + "\n" + replies[1] + "\n"


def test_chat_template_flag_replaces_the_models(tiny_gguf, tmp_path):
    """--chat-template FILE (or the text itself): replies are the model's continuation of the prompt that template
    renders, here written out by hand; one that does not parse, or a missing file, is one line before loading
    (serve too)."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "plain.jinja").write_text(template, encoding="utf-8")
    expected = LLM(tiny_gguf).generate("<user>Hi!\n<assistant>", max_tokens=6, temperature=0).text
    for value in (tmp_path / "plain.jinja", template):
        done = deltaserve("chat", tiny_gguf, "-n", "6", "--temperature", "0", "--chat-template", value, stdin="Hi!\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected + "\n"
    for command in ("chat", "serve"):
        broken = deltaserve(command, tiny_gguf, "--chat-template", "{% for m in %}", stdin="Hi!\n", timeout=60)
        assert broken.returncode == 1 and broken.stderr.strip().startswith("deltaserve: error: chat template does not "
                                                                           "parse: ")
    missing = deltaserve("chat", tiny_gguf, "--chat-template-file", tmp_path / "nope.jinja", stdin="Hi!\n")
    assert missing.returncode == 1 and "cannot read the chat template" in missing.stderr


def test_chat_thinks_to_stderr_switches_thinking_and_quits_on_exit(tiny_gguf):
    """Thinking on (the template opens <think>): the reply is thinking, on stderr; /think off: the answer,
    on stdout; /exit quits before the last line."""
    done = deltaserve("chat", tiny_gguf, "-n", "6", "--temperature", "0",
                      stdin="Hi!\n/think off\nHi!\n/exit\nnever read\n")
    assert done.returncode == 0, done.stderr
    llm = LLM(tiny_gguf)
    tok = llm.tokenizer
    first = [{"role": "user", "content": "Hi!"}]
    thought = llm.generate(tok.chat_prompt(first), max_tokens=6, temperature=0).text
    assert "</think>" not in thought and thought.strip() in done.stderr and "thinking off" in done.stderr
    history = [*first, {"role": "assistant", "content": "", "reasoning_content": thought.strip()},
               {"role": "user", "content": "Hi!"}]
    answer = llm.generate(tok.chat_prompt(history, enable_thinking=False), max_tokens=6, temperature=0).text
    assert done.stdout == "\n" + answer + "\n"


def test_chat_draws_a_fresh_seed_each_reply_unless_one_is_given(tiny_gguf):
    lines = "Tell me a story\n" * 2
    unseeded = deltaserve("chat", tiny_gguf, "-n", "8", "--temperature", "1.5", "--no-think", stdin=lines)
    seeded = deltaserve("chat", tiny_gguf, "-n", "8", "--temperature", "1.5", "--no-think", "--seed", "7", stdin=lines)
    assert unseeded.returncode == seeded.returncode == 0, unseeded.stderr + seeded.stderr
    llm = LLM(tiny_gguf)
    prompt = llm.tokenizer.chat_prompt([{"role": "user", "content": "Tell me a story"}], enable_thinking=False)
    expected = llm.generate(prompt, max_tokens=8, temperature=1.5, seed=7, top_k=40, top_p=0.95, min_p=0.05).text
    assert seeded.stdout.startswith(expected + "\n")
    again = deltaserve("chat", tiny_gguf, "-n", "8", "--temperature", "1.5", "--no-think", stdin=lines)
    assert len({unseeded.stdout, again.stdout}) == 2  # (the CLI's sampling defaults: top_k 40, top_p 0.95, min_p 0.05)
    assert seeded.stdout == deltaserve("chat", tiny_gguf, "-n", "8", "--temperature", "1.5", "--no-think", "--seed",
                                       "7", stdin=lines).stdout


def test_ctrl_c_stops_the_reply_not_the_chat(tiny_gguf):
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "chat", str(tiny_gguf), "-n", "4000", "-c",
                             "4096", "--no-think", "--temperature", "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"DELTASERVE_NO_PROGRESS": "1", "PATH": ""},
                            # a shell's background job starts with SIGINT ignored, and Python keeps that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdin.write("Tell me a story\n")
        proc.stdin.flush()
        proc.stdout.read(20)  # it is writing the reply
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in err and "Traceback" not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(command):
    done = deltaserve(command, "--help")
    assert done.returncode == 0 and "usage: " in done.stdout and len(done.stdout.splitlines()) > 5


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_nothing_heavy(command):
    """--help answers without torch & co: python's import log (-X importtime) lists every module loaded."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "deltaserve", *command.split(), "--help"],
                          text=True, capture_output=True, timeout=60, env={"PATH": ""})
    seconds = time.perf_counter() - start
    assert done.returncode == 0 and "usage: deltaserve" in done.stdout, done.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "deltaserve.cli" in loaded  # the log is read right
    assert {name.split(".")[0] for name in loaded} & HEAVY == set()
    assert seconds < 1.5


def test_make_model_choices_are_the_makers():
    """The CLI writes the maker's names out (importing them would import torch); they must agree."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    maker = commands.choices["make-model"]
    choices = {a.dest: set(a.choices) for a in maker._actions if a.choices}
    assert choices == {"arch": set(convert.PRESETS), "preset": set(presets.PRESET_NAMES), "dtype": set(convert.DTYPES),
                       "quantize": set(convert.QUANTIZE_TYPES), "vocab": set(convert.VOCABULARIES)}
    assert {name for arch in convert.PRESETS.values() for name in arch} == set(presets.PRESET_NAMES)


def test_tool_call_parser_choices_are_the_servers():
    from deltaserve.server.chat_output import PARSERS

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    [parser] = [a for a in commands.choices["serve"]._actions if a.dest == "tool_call_parser"]
    assert set(parser.choices) == set(PARSERS) and parser.default == "auto"


def test_make_model_writes_what_the_maker_writes(tmp_path):
    done = deltaserve("make-model", "--arch", "qwen35", "--dtype", "f32", "--seed", "3", tmp_path / "cli.gguf")
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'cli.gguf'}" in done.stderr
    # stderr is a pipe here, not a terminal: only the last progress line, not one rewritten per tensor
    assert "\r" not in done.stderr and done.stderr.count(" tensors, ") == 1, done.stderr
    convert.make_model("qwen35", "tiny", "f32", tmp_path / "api.gguf", seed=3)
    assert (tmp_path / "cli.gguf").read_bytes() == (tmp_path / "api.gguf").read_bytes()


def test_a_missing_model_is_one_clear_line(tmp_path):
    done = deltaserve("run", tmp_path / "nope.gguf", "-p", "x")
    assert done.returncode == 1
    assert done.stderr.strip() == f"deltaserve: error: {tmp_path / 'nope.gguf'}: file not found"


def test_a_corrupt_model_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    done = deltaserve("run", bad, "-p", "x")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"deltaserve: error: {bad}")


def test_run_without_a_model_uses_the_embedded_one():
    done = deltaserve("run", "-p", "ROMEO:", "-n", "40", "--seed", "1")
    assert done.returncode == 0, done.stderr
    text = done.stdout[len("ROMEO:"):]
    assert done.stdout.startswith("ROMEO:") and len(text.split()) >= 10  # about 40 tokens of words


def _numeric_flags():
    """(command, option strings, type) of every flag that takes a number."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, action.option_strings, action.type) for name, parser in commands.choices.items()
            for action in parser._actions if action.type not in (None, str, Path)]


def test_every_numeric_flag_is_range_checked():
    flags = _numeric_flags()
    assert len(flags) >= 15
    unchecked = [(name, opts) for name, opts, kind in flags
                 if kind.__qualname__.split(".")[0] not in ("_int", "_float", "_logit_bias")]
    assert unchecked == []


BASE = {"serve": ["serve"], "run": ["run", "-p", "x"], "make-model": ["make-model", "--arch", "qwen35", "out.gguf"]}


@pytest.mark.parametrize("command, flag, value", [
    ("serve", "--chunk-size", "0"), ("serve", "-t", "-1"), ("serve", "--ctx-size", "1"), ("serve", "--slots", "0"),
    ("serve", "--port", "65536"), ("serve", "--max-queue", "-1"), ("serve", "--max-request-bytes", "0"),
    ("serve", "--cache-mb", "-1"), ("serve", "--cache-mb", "nan"), ("serve", "--spec-tokens", "0"),
    ("run", "--max-tokens", "-1"), ("run", "--temperature", "inf"), ("run", "--temperature", "-0.5"),
    ("run", "--top-k", "-1"), ("run", "--top-p", "0"), ("run", "--top-p", "1.01"), ("run", "--min-p", "-0.1"),
    ("run", "--seed", str(2**64)), ("make-model", "--seed", "-1"), ("serve", "--slots", "two"),
    ("run", "--top-p", "half"), ("run", "--repetition-penalty", "0"), ("run", "--presence-penalty", "2.5"),
    ("run", "--frequency-penalty", "-2.01"), ("run", "--logit-bias", "5+101"), ("run", "--logit-bias", "5-nan"),
])
def test_out_of_range_flags_are_one_clear_line(command, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*BASE[command], flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and "Traceback" not in err
    assert "out of range" in err or "is not an integer" in err or "is not a number" in err


@pytest.mark.parametrize("command, flag, value", [
    ("serve", "--port", "0"), ("serve", "--max-queue", "0"), ("serve", "--cache-mb", "0"), ("run", "--top-p", "1"),
    ("run", "--min-p", "1"), ("run", "--min-p", "0"), ("run", "--temperature", "0"), ("run", "--seed", str(-2**63)),
    ("run", "--seed", str(2**64 - 1)), ("run", "--max-tokens", "0"), ("run", "--presence-penalty", "-2"),
    ("run", "--frequency-penalty", "2"),
])
def test_flags_at_the_edges_of_their_range_are_taken(command, flag, value):
    parsed = getattr(build_parser().parse_args([*BASE[command], flag, value]), flag.lstrip("-").replace("-", "_"))
    assert parsed == type(parsed)(value)


@pytest.mark.parametrize("flag, value", [("--chunk-size", "0"), ("-t", "-1")])
def test_serve_refuses_the_issues_flags_at_once(flag, value):
    """`serve --chunk-size 0` made every request hang; `-t -1` ended in a traceback."""
    start = time.perf_counter()
    done = deltaserve("serve", flag, value, timeout=60)
    assert done.returncode == 2 and "out of range" in done.stderr and "Traceback" not in done.stderr
    assert time.perf_counter() - start < 5
