"""deltaserve beside llama.cpp as the context grows: one prompt length per worker process.

    deltaserve bench MODEL.gguf --against llama.cpp --prompt 512,8192,32768 [--decode 16] [--json out.json]

For each prompt length each engine runs in a fresh process (so its peak RSS is that length's own) with its
default settings: deltaserve through its scheduler as a request is served (KV cache dtype auto, prefix
checkpoints on within the default budget, taken where the server takes them), llama.cpp through
llama-cpp-python with a context of that length. Measured: prefill tokens/s of the prompt, decode tokens/s
of `--decode` greedy tokens continuing it (at that context), peak RSS; for deltaserve also the bytes of
its KV cache and recurrent state and of the prefix checkpoints the prompt left, which its RSS includes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from deltaserve.bench import llama_peer, peak_rss_mb
from deltaserve.bench.compare import _prompt

METRICS = ("prefill", "decode", "peak_rss_mb")


def worker_deltaserve(model: str, n: int, decode: int, batch: int, threads: int) -> dict:
    import torch

    from deltaserve.engine.llm import LLM
    from deltaserve.engine.request import Request
    from deltaserve.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, max_len=n + decode + 8, prefill_chunk=batch)  # every other setting its default
    cache = llm.runner.cache

    def serve(ids: list[int]) -> tuple[float, float, int]:
        req = Request(ids, SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True), llm.tokenizer)
        llm.scheduler.add(req)
        t0 = time.perf_counter()
        while not req.output_ids and req.done is None:  # the first token ends the prefill
            llm.scheduler.step()
        t1 = time.perf_counter()
        while req.done is None:
            llm.scheduler.step()
        if req.done.error:
            raise RuntimeError(req.done.error)
        return t1 - t0, time.perf_counter() - t1, len(req.output_ids)

    vocab = llm.model.config.vocab_size
    serve(_prompt(32, vocab, seed=1))  # warm-up: kernel load, allocator
    prefill_s, decode_s, made = serve(_prompt(n, vocab))
    store = cache.store
    return {"prefill": n / prefill_s, "decode": (made - 1) / decode_s,
            "state_mb": cache.state.nbytes() / 1e6, "checkpoint_mb": (store.nbytes if store else 0) / 1e6,
            "checkpoints": store.checkpoints if store else 0}


def worker_llama(model: str, n: int, decode: int, batch: int, threads: int) -> dict:
    import numpy as np

    llm = llama_peer.open_llama(model, n_ctx=n + decode + 8, n_batch=batch, n_ubatch=batch, n_threads=threads,
                                n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    llm.eval(_prompt(32, vocab, seed=1))  # warm-up
    llm.reset()
    t = time.perf_counter()
    llm.eval(_prompt(n, vocab))
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(decode - 1):  # as deltaserve: the first token comes with the prefill
        llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))])
    return {"prefill": n / prefill_s, "decode": (decode - 1) / (time.perf_counter() - t)}


def _run(engine: str, n: int, args) -> dict:
    cmd = [sys.executable, "-m", "deltaserve.bench.context", "--worker", engine, args.model, str(n),
           str(args.decode), str(args.batch), str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DELTASERVE_NO_PROGRESS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker at {n} tokens failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    """args: model, against, prompt (lengths), decode, batch, threads, reps, json (see compare.main)."""
    if args.decode < 2:
        raise SystemExit("--decode must be at least 2 with --prompt (the first token ends the prefill)")
    engines = ["deltaserve"] + (["llama.cpp"] if args.against == "llama.cpp" else [])
    runs = {n: {e: [] for e in engines} for n in args.prompt}
    for n in args.prompt:
        for rep in range(args.reps):
            for engine in engines:
                runs[n][engine].append(_run(engine, n, args))
                print(f"{n} tokens, rep {rep + 1}/{args.reps}, {engine}: {runs[n][engine][-1]}", file=sys.stderr,
                      flush=True)
    median = {n: {e: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for e, rs in by.items()}
              for n, by in runs.items()}
    _table(args, engines, median)
    load = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "decode_tokens": args.decode,
                       "load_average": load, "runs": runs, "median": median}, f, indent=2)
        print(f"wrote {args.json}")
    return median


def _table(args, engines: list[str], median: dict) -> None:
    print(f"\n{os.path.basename(args.model)}, {args.threads} threads, median of {args.reps}, decode "
          f"{args.decode} tokens after the prompt, load average {os.getloadavg()[0]:.1f}")
    print(f"{'prompt':>8}  {'metric':<16}" + "".join(f"{e:>14}" for e in engines)
          + ("       ratio" if len(engines) > 1 else ""))
    units = {"prefill": "prefill tok/s", "decode": "decode tok/s", "peak_rss_mb": "peak RSS MB"}
    for n, by in median.items():
        for i, m in enumerate(METRICS):
            row = f"{n if i == 0 else '':>8}  {units[m]:<16}" + "".join(f"{by[e][m]:>14,.1f}" for e in engines)
            if len(engines) > 1:
                row += f"{by['deltaserve'][m] / by['llama.cpp'][m]:>11.2f}x"
            print(row)
    if "llama.cpp" in engines:
        print(llama_peer.note())
    print("deltaserve memory held (within its peak RSS): " + "; ".join(
        f"{n}: KV cache + recurrent state {by['deltaserve']['state_mb']:,.0f} MB, "
        f"{by['deltaserve']['checkpoints']:.0f} prefix checkpoints {by['deltaserve']['checkpoint_mb']:,.0f} MB"
        for n, by in median.items()))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    engine, model, n, decode, batch, threads = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])
    result = (worker_deltaserve if engine == "deltaserve" else worker_llama)(model, n, decode, batch, threads)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))
