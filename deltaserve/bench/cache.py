"""Benchmark of the recurrent state cache: prefix checkpoints and prompt-lookup speculative decoding.

    python -m deltaserve.bench.cache [--arch qwen35] [--preset tiny] [--dtype f32] [--prefix 2000] [--json out.json]

1. Time to first token of a request that shares a `--prefix`-token prefix with the request before it
   (a long system prompt and earlier turns) but ends in a different last turn: restored from the prefix
   checkpoints, against a fresh prefill of the same prompt. The model is made with make_model.
2. Greedy decode tokens/s with prompt-lookup (n-gram) speculative decoding against plain decoding, with
   the acceptance rate, on a "rewrite this paragraph" prompt. It runs the embedded trained model
   (deltaserve/data/default.gguf), which repeats text as small models do; without it, the made random
   model, whose output rarely repeats anything (the output says which).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from deltaserve.engine.speculative import make_speculator
from deltaserve.engine.llm import DEFAULT_MODEL, LLM
from deltaserve.engine.request import Request
from deltaserve.engine.sampling import SamplingParams
from deltaserve.convert import make_model

PARAGRAPH = ("But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
             "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, "
             "that thou her maid art far more fair than she.")
PROMPT = f"Rewrite this paragraph:\n{PARAGRAPH}\nRewritten:\n{PARAGRAPH[:40]}"


def _fastest_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: the one least disturbed by whatever else the machine does."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def shared_prefix(path: Path, prefix: int, turn: int, interval: int, repeats: int) -> dict:
    """TTFT of prefix + a new last turn: fresh prefill vs restored from the checkpoints the last request left."""
    fresh = LLM(path, max_len=prefix + 4 * turn, cache_budget_mb=0)
    cached = LLM(path, max_len=prefix + 4 * turn, checkpoint_interval=interval)
    vocab = fresh.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + turn * (repeats + 1),), generator=gen).tolist()
    common, turns = ids[:prefix], [ids[prefix + i * turn:prefix + (i + 1) * turn] for i in range(repeats + 1)]
    second = common + turns[-1]  # the request being timed

    def first_token(llm, prompt):
        llm.generate(prompt, max_tokens=1, temperature=0)

    fresh_s = _fastest_seconds(lambda: (fresh.runner.reset(0), first_token(fresh, second)), repeats)
    cached_times, reused = [], []
    for i in range(repeats):
        cached.generate(common + turns[i], max_tokens=8, temperature=0, ignore_eos=True)  # another user's request
        before = cached.runner.cache.restored_tokens
        t = time.perf_counter()
        first_token(cached, second)
        cached_times.append(time.perf_counter() - t)
        reused.append(cached.runner.cache.restored_tokens - before)
    store = cached.runner.cache.store
    return {"prompt_tokens": len(second), "prefix_tokens": prefix, "checkpoint_interval": interval,
            "ttft_fresh_s": fresh_s, "ttft_cached_s": min(cached_times), "speedup": fresh_s / min(cached_times),
            "restored_tokens": reused[-1],
            "checkpoints": store.checkpoints, "store_bytes": store.nbytes,
            "cache_bytes": cached.runner.cache.nbytes()}


def ngram_decode(path: Path, tokens: int, spec_tokens: int, repeats: int) -> dict:
    """Greedy decode tokens/s of PROMPT with and without prompt lookup: the clock runs from the first
    generated token (prefill done) to the last; plain and speculative runs alternate, the fastest counts."""
    llm = LLM(path, max_len=4096, cache_budget_mb=0)
    ids = llm.tokenizer.encode(PROMPT)
    ngram = make_speculator("ngram", llm.runner, spec_tokens)

    def decode(speculator):
        llm.runner.reset(0)
        req = Request(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), llm.tokenizer)
        llm.scheduler.add(req, speculator)
        while not req.output_ids:  # prefill, which samples the first token
            llm.scheduler.step()
        t = time.perf_counter()
        while req.done is None:
            llm.scheduler.step()
        seconds = time.perf_counter() - t
        llm.scheduler.step()  # frees the slot
        return seconds, req.output_ids

    runs = {"plain": [], "ngram": []}
    for _ in range(repeats):
        runs["plain"].append(decode(None))
        runs["ngram"].append(decode(ngram))
    rate = {name: (tokens - 1) / min(s for s, _ in r) for name, r in runs.items()}
    return {"prompt_tokens": len(ids), "generated_tokens": tokens, "spec_tokens": spec_tokens,
            "plain_tok_s": rate["plain"], "ngram_tok_s": rate["ngram"], "speedup": rate["ngram"] / rate["plain"],
            "acceptance_rate": ngram.acceptance_rate, "tokens_per_step": (ngram.accepted + ngram.steps) / max(ngram.steps, 1),
            "identical": all(out == runs["plain"][0][1] for r in runs.values() for _, out in r),
            "sample": llm.tokenizer.decode(runs["plain"][0][1][:60])}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen35", help="architecture of the made model (default qwen35)")
    p.add_argument("--preset", default="tiny", help="make_model preset: tiny, 0.8b (default tiny)")
    p.add_argument("--dtype", default="f32", help="make_model dtype: f32, f16, q8_0 (default f32)")
    p.add_argument("--prefix", type=int, default=2000, help="shared prefix in tokens (default 2000)")
    p.add_argument("--turn", type=int, default=24, help="tokens of the last turn (default 24)")
    p.add_argument("--interval", type=int, default=512, help="checkpoint interval (default 512, the engine's)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to decode (default 200)")
    p.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default="bench_cache.json", help="where to write the results (default bench_cache.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        made = Path(tmp) / f"{args.arch}-{args.preset}-{args.dtype}.gguf"
        make_model(args.arch, args.preset, args.dtype, made, seed=0)
        prefix = shared_prefix(made, args.prefix, args.turn, args.interval, args.repeats)
        trained = DEFAULT_MODEL.exists()
        ngram = ngram_decode(DEFAULT_MODEL if trained else made, args.tokens, args.spec_tokens, args.repeats)
    model_name = f"{args.arch} {args.preset} {args.dtype} (random weights)"
    ngram_model = "embedded trained model (default.gguf)" if trained else \
        f"{model_name}: no trained model here, its output rarely repeats, so few drafts are accepted"
    result = {"platform": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "shared_prefix": {"model": model_name, **prefix}, "ngram_spec": {"model": ngram_model, **ngram}}

    print(f"shared prefix, {model_name}, {prefix['prefix_tokens']}-token prefix + {args.turn}-token last turn, "
          f"checkpoints every {args.interval}")
    print(f"  {'TTFT fresh prefill':<32}{prefix['ttft_fresh_s'] * 1e3:>10.1f} ms")
    print(f"  {'TTFT from checkpoint':<32}{prefix['ttft_cached_s'] * 1e3:>10.1f} ms   "
          f"({prefix['restored_tokens']} tokens restored, {prefix['checkpoints']} checkpoints, "
          f"{prefix['store_bytes'] / 2**20:.1f} MB)")
    print(f"  {'speedup':<32}{prefix['speedup']:>10.1f} x")
    print(f"prompt-lookup speculative decoding, {ngram_model}, k = {args.spec_tokens}, {args.tokens} tokens")
    print(f"  {'plain decode':<32}{ngram['plain_tok_s']:>10.1f} tok/s")
    print(f"  {'ngram speculative decode':<32}{ngram['ngram_tok_s']:>10.1f} tok/s")
    print(f"  {'speedup':<32}{ngram['speedup']:>10.2f} x")
    print(f"  {'acceptance rate':<32}{ngram['acceptance_rate']:>10.1%}   "
          f"({ngram['tokens_per_step']:.2f} tokens per verify pass)")
    print(f"  {'greedy output identical':<32}{'yes' if ngram['identical'] else 'NO':>10}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
