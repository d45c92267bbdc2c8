"""Greedy decoding with the model's MTP layer drafting (`--spec mtp`) against plain decoding, k = 1..4.

    python -m deltaserve.bench.mtp MODEL.gguf [--tokens 64] [--reps 2] [--prompt TEXT | --chat QUESTION] [--threads N]

One LLM decodes the same prompt plainly and with k = 1, 2, 3, 4 in turn, `--reps` rounds; the fastest run of
each counts. Decode: the tokens after the first over the call's time less that of the same call for one token (the
prefill and first sample); whole call: every token over the call's time, prefill included. Each also per second of
the process's CPU time, which other processes on a busy machine disturb less (with --threads 1 it is the work
itself; with more, threads spinning at barriers count too). Every run must give the plain tokens. Acceptance: of all drafts, of each step's first draft, and tokens accepted per step.
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.engine.llm import LLM

PROMPT = "the cat sat on the mat and the dog sat on the log; the cat sat"


def measure(path: str, tokens: int, reps: int, prompt: str = PROMPT, chat: str | None = None) -> dict[int, dict]:
    """chat: a question asked through the model's chat template instead of the plain prompt."""
    llm = LLM(path, max_len=tokens + 512, checkpoint_interval=0)
    if chat is not None:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": chat}])
    kw = dict(temperature=0, ignore_eos=True)
    plain = llm.generate(prompt, max_tokens=tokens, speculative=False, **kw).token_ids
    rows: dict[int, dict] = {}
    for _ in range(reps):
        for k in (0, 1, 2, 3, 4):
            llm.spec_tokens = max(k, 1)
            llm.speculators.clear()
            spec = "mtp" if k else False
            llm.generate(prompt, max_tokens=1, speculative=spec, **kw)  # first use (a runner, plans) is not timed
            first, first_cpu = _timed(lambda: llm.generate(prompt, max_tokens=1, speculative=spec, **kw))[1:]
            llm.speculators.clear()
            out, seconds, cpu = _timed(lambda: llm.generate(prompt, max_tokens=tokens, speculative=spec, **kw))
            if out.token_ids != plain:
                raise AssertionError(f"k={k}: the output differs from plain decoding")
            row = rows.setdefault(k, dict.fromkeys(("tok_s", "cpu_tok_s", "decode", "cpu_decode"), 0.0))
            for key, rate in (("tok_s", tokens / seconds), ("cpu_tok_s", tokens / cpu),
                              ("decode", (tokens - 1) / (seconds - first)), ("cpu_decode", (tokens - 1) / (cpu - first_cpu))):
                row[key] = max(row[key], rate)
            s = llm.speculators.get("mtp")
            if s is not None:
                row |= {"acceptance": s.acceptance_rate, "first": s.first_acceptance_rate,
                        "per_step": s.accepted / s.steps if s.steps else 0.0}
    return rows


def _timed(call):
    """(call's result, wall seconds, process CPU seconds)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = call()
    return out, time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a GGUF file or Hugging Face directory with an MTP layer")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt", default=PROMPT, help="the text to continue (default: %(default)r)")
    p.add_argument("--chat", metavar="QUESTION", help="ask this through the chat template instead")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a busy machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.model, args.tokens, args.reps, args.prompt, args.chat)
    plain = rows[0]
    for k, row in rows.items():
        line = (f"k={k}  decode {row['decode']:6.1f} tok/s {row['decode'] / plain['decode']:5.2f}x, per CPU s "
                f"{row['cpu_decode']:6.1f} {row['cpu_decode'] / plain['cpu_decode']:5.2f}x;  whole call "
                f"{row['tok_s']:6.1f} {row['tok_s'] / plain['tok_s']:5.2f}x, per CPU s {row['cpu_tok_s']:6.1f} "
                f"{row['cpu_tok_s'] / plain['cpu_tok_s']:5.2f}x")
        if k:
            line += (f";  acceptance {row['acceptance']:.3f}, first draft {row['first']:.3f}, "
                     f"accepted per step {row['per_step']:.2f}")
        print(line)

if __name__ == "__main__":
    main()
