"""A bounded load test: 16 concurrent streaming clients for 30 s against the tiny model on loopback. A
quarter of them ask for greedy tokens, which must be exactly the tokens of the same request alone. The
queue holds twice the 4 slots: the clients it turns away (503) wait as Retry-After says and try again."""

import asyncio
import gc
import json
import os
import time

import httpx
import pytest

from deltaserve.engine.llm import LLM

CLIENTS, SECONDS = 16, float(os.environ.get("DELTASERVE_LOAD_SECONDS", 30))
GREEDY_PROMPTS, GREEDY_TOKENS = [f"Greedy prompt {k}:" for k in range(4)], 16


@pytest.fixture(scope="module")
def alone(tiny_gguf) -> dict[str, list[int]]:
    """The greedy token ids of each greedy prompt, from the model alone (LLM)."""
    llm = LLM(tiny_gguf, max_len=512)
    return {p: llm.generate(p, max_tokens=GREEDY_TOKENS, temperature=0).token_ids for p in GREEDY_PROMPTS}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def busy(r: httpx.Response, stats: dict) -> bool:
    """Whether the queue was full (16 clients, 4 slots, 8 places in the queue): then wait as told."""
    if r.status_code != 503:
        return False
    await r.aread()
    stats["busy"] += 1
    await asyncio.sleep(float(r.headers["retry-after"]))
    return True


async def greedy_client(url: str, i: int, deadline: float, stats: dict, alone: dict[str, list[int]]):
    """Streams greedy completions with return_token_ids and compares them with the tokens alone."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            prompt = GREEDY_PROMPTS[(i + n) % len(GREEDY_PROMPTS)]
            body = {"prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "stream": True,
                    "return_token_ids": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if await busy(r, stats):
                    continue
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            ids = [t for line in lines for t in json.loads(line[6:])["choices"][0]["token_ids"]]
            stats["greedy"] += 1
            if ids != alone[prompt]:
                stats["errors"].append(f"greedy under load differs for {prompt!r}: {ids} != {alone[prompt]}")


async def client(url: str, i: int, deadline: float, stats: dict):
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            body = {"messages": [{"role": "user", "content": f"client {i} request {n}"}], "stream": True,
                    "max_tokens": 8 + (i + n) % 24, "temperature": 0.7, "seed": i * 1000 + n}
            if n % 5 == 0:  # some clients walk away mid-stream
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if await busy(r, stats):
                        continue
                    async for _ in r.aiter_lines():
                        break
                stats["abandoned"] += 1
                continue
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if await busy(r, stats):
                    continue
                if r.status_code != 200:
                    stats["errors"].append(f"HTTP {r.status_code}")
                    continue
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            if lines[-1] != "data: [DONE]" or any("error" in json.loads(x[6:]) for x in lines[:-1]):
                stats["errors"].append(lines[-2:])
            stats["done"] += 1


def test_sixteen_streaming_clients(server, engine, alone):
    gc.collect()
    store = engine.runner.cache.store
    baseline = rss_bytes() - store.nbytes
    stats = {"done": 0, "abandoned": 0, "greedy": 0, "busy": 0, "errors": []}

    async def main():
        deadline = time.monotonic() + SECONDS
        await asyncio.gather(*(greedy_client(server.url, i, deadline, stats, alone) if i % 4 == 0
                               else client(server.url, i, deadline, stats) for i in range(CLIENTS)))

    asyncio.run(main())
    print(f"\nload: {stats['done']} streams read to the end, {stats['abandoned']} abandoned, {stats['greedy']} greedy "
          f"compared with the tokens alone, {stats['busy']} told to retry (queue full)")
    deadline = time.time() + 30
    while time.time() < deadline and (engine.running() or engine.queue_depth()):
        time.sleep(0.1)
    assert stats["errors"] == []
    assert stats["done"] >= CLIENTS and stats["greedy"] >= CLIENTS // 4
    assert engine.running() == 0 and engine.queue_depth() == 0
    assert engine.runner.free_slots() == engine.runner.n_slots, "a slot leaked"
    gc.collect()
    # what the requests leave is the prefix checkpoints (marks, answer ends), within the cache budget
    assert store.nbytes <= store.budget
    assert rss_bytes() - store.nbytes - baseline < 100 * 2 ** 20, "memory did not come back to its baseline"
