"""Serving throughput: total generated tokens/s with 1 client and with N concurrent clients, same server.

    python -m deltaserve.bench.serve [MODEL.gguf] [--clients 1 8] [--tokens 64] [--json out.json]

Starts `deltaserve serve` on a free loopback port in a subprocess, sends greedy streaming completions
(usage counts what each really generated), and prints tokens/s per setting and the ratio
to one client. Continuous batching decodes the concurrent requests as one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx


async def _one_client(url: str, i: int, tokens: int, rounds: int) -> int:
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for r in range(rounds):
            body = {"prompt": f"Client {i} round {r}: the story of", "max_tokens": tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            n += usage["completion_tokens"]
    return n


async def _measure(url: str, clients: int, tokens: int, rounds: int) -> float:
    t = time.perf_counter()
    counts = await asyncio.gather(*(_one_client(url, i, tokens, rounds) for i in range(clients)))
    return sum(counts) / (time.perf_counter() - t)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrency levels (default 1 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client (default 2)")
    p.add_argument("--serve-args", default="", help="more `deltaserve serve` options, e.g. '--spec mtp --spec-max-batch 4'")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args(argv)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port), "--slots", str(max(args.clients)),
           *args.serve_args.split()]
    server = subprocess.Popen(cmd + ([args.model] if args.model else []), stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        asyncio.run(_measure(url, 1, 8, 1))  # warm-up
        results = {c: asyncio.run(_measure(url, c, args.tokens, args.rounds)) for c in args.clients}
    finally:
        server.terminate()
        server.wait(timeout=30)
    base = results[args.clients[0]]
    print(f"{'clients':>8} {'tokens/s':>10} {'vs ' + str(args.clients[0]):>8}")
    for c, r in results.items():
        print(f"{c:>8} {r:>10.1f} {r / base:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "tokens_per_second": results}, f, indent=2)


if __name__ == "__main__":
    main()
