"""`deltaserve chat`: a conversation in the terminal.

The answer goes to stdout and the thinking to stderr (dimmed on a terminal), so a pipe collects answers
only. Ctrl-C while a reply is being written stops that reply (what was written stays in the history) and
the chat goes on; /exit, an empty line or end of input quits; /think on|off switches the template's
thinking. Each reply draws a fresh seed unless --seed fixes them all (the engine seeds a request without
a seed from the system's randomness)."""

from __future__ import annotations

import sys
from typing import TextIO

from deltaserve.callforms import THINK_OPEN
from deltaserve.engine.llm import LLM
from deltaserve.server.reasoning import REASONING, ReasoningSplitter, opens_thinking

HELP = "/exit (or an empty line, Ctrl-D) quits, Ctrl-C stops a reply, /think on|off switches thinking"
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def chat(llm: LLM, args, sampling: dict, stdin: TextIO | None = None) -> None:
    """Read a line, answer it, until the user quits. args: the chat command's (system, no_think)."""
    stdin = stdin or sys.stdin
    messages = [{"role": "system", "content": args.system}] if args.system else []
    thinking = not args.no_think
    print(f"deltaserve chat: {HELP}", file=sys.stderr)
    while True:
        try:  # a prompt and line editing on a terminal; plain lines from a pipe
            line = input("> ") if stdin.isatty() else stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if line in ("", "/exit", "/quit"):
            break
        if line.startswith("/"):
            thinking = _command(line, thinking)
            continue
        messages.append({"role": "user", "content": line})
        messages.append(_reply(llm, messages, thinking, sampling))


def _command(line: str, thinking: bool) -> bool:
    """A /command: the thinking switch after it."""
    words = line.split()
    if words[0] == "/think" and words[1:] in (["on"], ["off"]):
        thinking = words[1] == "on"
        print(f"thinking {'on' if thinking else 'off'}", file=sys.stderr)
    else:
        print(f"unknown command {words[0]!r}: {HELP}", file=sys.stderr)
    return thinking


def _reply(llm: LLM, messages: list[dict], thinking: bool, sampling: dict) -> dict:
    """Stream the next reply to the terminal; the assistant message it adds to the history."""
    tok = llm.tokenizer
    prompt = tok.chat_prompt(messages, enable_thinking=thinking)
    thinks = opens_thinking(prompt) or THINK_OPEN in (tok.template or "")
    splitter = ReasoningSplitter(opens_thinking(prompt)) if thinks else None
    said = {"reasoning": "", "content": ""}

    def show(pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            said[kind] += text
            out = sys.stderr if kind == REASONING else sys.stdout
            dim = kind == REASONING and out.isatty()
            out.write(f"{DIM}{text}{PLAIN}" if dim else text)
            out.flush()

    stream = llm.generate(prompt, stream=True, **sampling)
    try:
        for piece in stream:
            show(splitter.feed(piece) if splitter else [("content", piece)])
    except KeyboardInterrupt:
        stream.close()  # its cleanup cancels the request and frees the slot
        print("\n[stopped]", file=sys.stderr)
    if splitter:
        show(splitter.finish())
    if said["reasoning"]:
        sys.stderr.write("\n")
    sys.stdout.write("\n")
    sys.stdout.flush()
    message = {"role": "assistant", "content": said["content"]}
    if said["reasoning"]:
        message["reasoning_content"] = said["reasoning"]
    return message
