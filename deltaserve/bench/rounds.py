"""Decode of both engines in alternating rounds, each loaded in its own process at once (the line under
bench/compare.py's table): the same seconds of the host for both.

compare.py's repetitions run one engine's worker after the other's, a minute or more apart, and on a shared host
memory's read rate moves that much by the minute (our float16 decode GEMVs streamed 37 GB/s in one repetition and
72 in the next): a memory-bound ratio then depends on which engine drew the faster minute. Here both workers load
their model and read the same 512-token prompt, then the parent has them decode a few tokens in turn, the order
flipped each round, so that neither always goes first; each round's ratio compares two runs seconds apart.

    worker:  python -m deltaserve.bench.rounds MODEL ENGINE THREADS CONTEXT [DTYPE]   (reads token counts on
             stdin, answers the seconds each took; prints "ready" once prefilled; DTYPE: deltaserve's, float32)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from deltaserve.bench import llama_peer

_PROMPT = 512


def _deltaserve(model: str, threads: int, context: int, dtype: str):
    """decode(n) for a deltaserve engine after the prompt: n greedy tokens, as compare.py's worker decodes."""
    import torch

    from deltaserve.bench.compare import _prompt
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import argmax_rows

    torch.set_num_threads(threads)
    llm = LLM(model, max_len=context, prefill_chunk=_PROMPT, dtype=getattr(torch, dtype), cache_budget_mb=0)
    runner = llm.runner
    runner.reset(0)
    logits = [runner.forward([0], [_prompt(_PROMPT, llm.model.config.vocab_size)])]

    def decode(n: int):
        for _ in range(n):
            logits[0] = runner.forward([0], [[argmax_rows(logits[0][:1])[0]]])

    return decode


def _llama(model: str, threads: int, context: int, dtype: str):
    """decode(n) for llama.cpp (llama-cpp-python) after the prompt, as compare.py's peer worker decodes."""
    import numpy as np

    from deltaserve.bench.compare import _prompt

    llm = llama_peer.open_llama(model, n_ctx=context, n_batch=_PROMPT, n_ubatch=_PROMPT, n_threads=threads,
                                n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(_prompt(_PROMPT, vocab))

    def decode(n: int):
        for _ in range(n):
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))])

    return decode


def _worker(model: str, engine: str, threads: int, context: int, dtype: str):
    decode = (_deltaserve if engine == "deltaserve" else _llama)(model, threads, context, dtype)
    decode(2)  # the first steps after a prefill touch buffers the rounds then reuse
    print("ready", flush=True)
    for line in sys.stdin:
        t = time.perf_counter()
        decode(int(line))
        print(f"{time.perf_counter() - t:.6f}", flush=True)


def _start(model: str, engine: str, threads: int, context: int, dtype: str) -> subprocess.Popen:
    """A worker, its stderr in a file (a pipe nobody reads while the rounds run could fill and stall it)."""
    cmd = [sys.executable, "-m", "deltaserve.bench.rounds", model, engine, str(threads), str(context), dtype]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "DELTASERVE_NO_PROGRESS": "1"})
    proc.log = log
    return proc


def _answer(proc: subprocess.Popen, engine: str) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        proc.log.seek(0)
        raise RuntimeError(f"{engine} rounds worker failed:\n{proc.log.read()[-2000:].decode(errors='replace')}")
    return line.strip()


def decode_rounds(models: dict[str, str], threads: int, rounds: int, tokens: int, dtype: str = "float32") -> dict:
    """Both engines' decode in `rounds` alternating rounds of `tokens` tokens each (models: engine -> file; dtype:
    deltaserve's compute dtype). Returns per engine its tokens/s over all rounds, and the rounds' ratios deltaserve /
    llama.cpp."""
    context = _PROMPT + 2 + rounds * tokens + 8
    procs = {e: _start(m, e, threads, context, dtype) for e, m in models.items()}
    try:
        for e, p in procs.items():
            if _answer(p, e) != "ready":
                raise RuntimeError(f"{e} rounds worker did not start")
        seconds = {e: [] for e in procs}
        order = list(procs)
        for r in range(rounds):
            for e in order if r % 2 == 0 else order[::-1]:
                procs[e].stdin.write(f"{tokens}\n")
                procs[e].stdin.flush()
                seconds[e].append(float(_answer(procs[e], e)))
    finally:
        for p in procs.values():  # EOF on stdin ends a worker; one still loading its model is stopped
            p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.log.close()
    return summarize(seconds, tokens)


def summarize(seconds: dict[str, list[float]], tokens: int) -> dict:
    """Tokens/s per engine over all its rounds, and the ratio per round (same round index: seconds apart)."""
    rate = {e: tokens * len(s) / sum(s) for e, s in seconds.items()}
    ratios = [b / a for a, b in zip(seconds["deltaserve"], seconds["llama.cpp"])]
    return {"decode_tok_s": rate, "ratio": rate["deltaserve"] / rate["llama.cpp"],
            "round_ratios": ratios, "round_ratio_median": statistics.median(ratios)}


def format_rounds(result: dict, rounds: int, tokens: int) -> str:
    rate, ratios = result["decode_tok_s"], result["round_ratios"]
    return (f"decode in {rounds} alternating rounds of {tokens} tokens, both engines loaded at once: "
            f"{rate['deltaserve']:,.1f} vs {rate['llama.cpp']:,.1f} tok/s = {result['ratio']:.2f}x "
            f"(rounds: median {result['round_ratio_median']:.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    model, engine, threads, context, *dtype = sys.argv[1:]
    _worker(model, engine, int(threads), int(context), dtype[0] if dtype else "float32")
