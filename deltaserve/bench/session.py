"""A multi-turn conversation through the OpenAI chat API, deltaserve beside llama-server on the same file.

    python -m deltaserve.bench.session MODEL.gguf [--against llama-server] [--turns 20] [--json out.json]
    deltaserve bench session MODEL.gguf --against llama-server

Both servers run at once, each in its own process, the turns alternating between them (whatever else the
machine runs weighs on both alike), on the same scripted conversation: user
turns of a few thousand characters, tool results every few turns, the model's own answers (greedy,
temperature 0) carried in the history, which the chat template re-renders without the thinking block its
generation prompt opened, so every prompt leaves the previous one where the assistant's turn started.
Reported per turn: prompt tokens, tokens actually prefilled (prompt minus those served from the cache; the
least share of the previous turn's prompt a turn reused is the figure for "only new tokens"),
time to first token; and the whole conversation's time (the sum of its turns' request times). With --restart, deltaserve is stopped
after the last turn and started again on the same --cache-dir, and answers one more turn.
llama-server comes from `scripts/install-llama-cpp.sh server`; it runs with its defaults for hybrid
models (context checkpoints on) and --jinja, so it renders the file's chat template too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deltaserve.convert.presets import TOKENIZER_TEXT


def script(turns: int, chars: int, tool_every: int) -> list[dict]:
    """The user's side: per turn a message (and, every tool_every turns, a tool result before it)."""
    paragraphs = [p.replace("\n", " ") for p in TOKENIZER_TEXT.split("\n\n")]
    out = []
    for turn in range(turns):
        text, i = f"Turn {turn + 1}. Read this and answer briefly.", turn
        while len(text) < chars:
            text += " " + paragraphs[i % len(paragraphs)]
            i += 3
        out.append({"user": text[:chars], "tool": f"result {turn}: {paragraphs[turn % len(paragraphs)][:400]}"
                    if tool_every and turn % tool_every == tool_every - 1 else None})
    return out


def _turn(http: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text, usage, timings = time.perf_counter(), None, [], {}, {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(delta.get("content") or "")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prefilled = timings["prompt_n"] if "prompt_n" in timings else prompt - (cached or 0)
    end = time.perf_counter() - start
    return {"prompt_tokens": prompt, "prefilled": prefilled, "ttft": first if first is not None else end,
            "time": end, "answer": "".join(text)}


class Conversation:
    """One server's side of the scripted conversation: its own history (its own answers), a turn at a time."""

    def __init__(self, url: str, history: list[dict] | None = None):
        self.url = url
        self.history = list(history or [{"role": "system", "content": "You are a careful reader."}])
        self.results: list[dict] = []

    def turn(self, t: dict, max_tokens: int) -> dict:
        if t["tool"] is not None:  # a call the assistant made and its result (an id ties them together)
            call = f"call_{len(self.history)}"
            self.history.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": "find_line", "arguments": json.dumps({"query": t["user"][:40]})}}]})
            self.history.append({"role": "tool", "tool_call_id": call, "content": t["tool"]})
        self.history.append({"role": "user", "content": t["user"]})
        # a connection per turn: llama-server (cpp-httplib) closes a kept-alive connection after a few
        # requests, and a turn sent on it just then fails with "server disconnected"
        with httpx.Client(base_url=self.url, timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            r = _turn(http, self.history, max_tokens)
        self.history.append({"role": "assistant", "content": r.pop("answer")})
        self.results.append(r)
        return r


class Server:
    """A server subprocess on a free loopback port, up once /health answers."""

    def __init__(self, cmd: list[str], name: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} did not start: {' '.join(cmd)}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def llama_server_cmd(model: str, ctx: int, extra: list[str]) -> list[str]:
    exe = shutil.which("llama-server") or str(Path(sys.executable).with_name("llama-server"))
    if not os.path.exists(exe):
        raise SystemExit("llama-server is not installed: run scripts/install-llama-cpp.sh server")
    return [exe, "-m", model, "-c", str(ctx), "-np", "1", "--jinja", "-t", str(os.cpu_count() or 1),
            "--host", "127.0.0.1", *extra]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file with a chat template")
    p.add_argument("--against", choices=["llama-server", "none"], default="llama-server")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--chars", type=int, default=3200, help="characters per user turn (default 3200: 16k tokens by turn 20)")
    p.add_argument("--tool-every", type=int, default=4, help="a tool result every N turns (0: none)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    p.add_argument("--ctx", type=int, default=24576, help="context of both servers (default 24576)")
    p.add_argument("--llama-flags", default="", help="more llama-server flags, e.g. '-cms 0' (default: none: "
                   "its defaults, 32 context checkpoints per slot at least 8192 tokens apart)")
    p.add_argument("--restart", action="store_true", help="restart deltaserve on its --cache-dir for one more turn")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args(argv)

    turns = script(args.turns + args.restart, args.chars, args.tool_every)
    cache_dir = tempfile.mkdtemp(prefix="deltaserve-session-")
    ours_cmd = [sys.executable, "-m", "deltaserve.cli", "serve", args.model, "--served-model-name", "m",
                "--slots", "1", "-c", str(args.ctx), "--cache-dir", cache_dir]
    cmds = [("deltaserve", ours_cmd)]
    if args.against == "llama-server":
        cmds.append(("llama-server", llama_server_cmd(args.model, args.ctx, args.llama_flags.split())))
    # Both servers up at once, the turns alternating between them: whatever else runs on the machine
    # weighs on both alike. A server idle between its turns takes no CPU.
    servers = {}
    try:
        for name, cmd in cmds:
            servers[name] = Server(cmd, name)
        talks = {name: Conversation(server.url) for name, server in servers.items()}
        for t in turns[:args.turns]:
            for talk in talks.values():
                talk.turn(t, args.max_tokens)
    finally:
        for server in servers.values():
            server.stop()
    runs = {name: {"turns": talk.results, "wall": sum(r["time"] for r in talk.results)} for name, talk in talks.items()}
    if args.restart:
        server = Server(ours_cmd, "deltaserve")
        try:
            again = Conversation(server.url, talks["deltaserve"].history)
            runs["deltaserve"]["after_restart"] = again.turn(turns[args.turns], args.max_tokens)
        finally:
            server.stop()
    shutil.rmtree(cache_dir, ignore_errors=True)
    report(runs, args)
    return 0


def report(runs: dict, args) -> None:
    names = list(runs)
    head = f"{'turn':>4} {'prompt':>7}" + "".join(f" {n + ' prefilled':>22} {n + ' TTFT s':>19}" for n in names)
    print(head)
    for i in range(args.turns):
        row = f"{i + 1:>4} {runs[names[0]]['turns'][i]['prompt_tokens']:>7}"
        for n in names:
            t = runs[n]["turns"][i]
            row += f" {t['prefilled']:>22} {t['ttft']:>19.3f}"
        print(row)
    for n in names:
        r = runs[n]
        reused = 1 - sum(t["prefilled"] for t in r["turns"][1:]) / max(1, sum(t["prompt_tokens"] for t in r["turns"][1:]))
        history = min((min(1.0, (t["prompt_tokens"] - t["prefilled"]) / before["prompt_tokens"])
                       for before, t in zip(r["turns"], r["turns"][1:])), default=1.0)
        print(f"{n}: total {r['wall']:.1f} s (its turns' request times), turn {args.turns} TTFT {r['turns'][-1]['ttft']:.3f} s, "
              f"{100 * reused:.1f}% of turns 2.. served from the cache; each turn reused at least "
              f"{100 * history:.1f}% of the previous prompt")
        if "after_restart" in r:
            t = r["after_restart"]
            print(f"{n} restarted on its cache dir: turn {args.turns + 1} prefilled {t['prefilled']} of "
                  f"{t['prompt_tokens']}, TTFT {t['ttft']:.3f} s")
    if len(names) == 2:
        a, b = (runs[n] for n in names)
        print(f"ratios {names[1]} / {names[0]}: turn {args.turns} TTFT "
              f"{b['turns'][-1]['ttft'] / a['turns'][-1]['ttft']:.1f}x, total {b['wall'] / a['wall']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "runs": runs}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
