"""Pipeline or tensor parallel on one machine: prefill and decode tokens/s of 1 and N ranks, bytes exchanged,
peak RSS per rank.

    python -m deltaserve.bench.dist MODEL.gguf [--pp 2 | --pp 1 --tp 2] [--prompt 512] [--decode 64] [--threads T]

Every configuration runs in processes of its own (torch.multiprocessing, gloo over loopback), one after the
other: a single process with T threads, then N ranks with T / N threads each, so both use the same cores.
On one machine pipeline stages only take turns (no micro-batching): expect no speed-up, only the overhead
of the hand-offs; tensor shards split the work but wait on two all-reduces a layer. Reported beside it: the
bytes rank 0 sent and received per decoded token, what those bytes would take on a 10 Gb/s link, and each
rank's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time

LINK_BITS_PER_S = 10e9


def _measure(model, prompt: list[int], decode: int, moved=lambda: 0) -> dict:
    """Prefill `prompt` in one pass, then `decode` single-token steps; tokens/s of each, and what `moved`
    (bytes exchanged so far) grew by per decoded token."""
    import torch

    from deltaserve.engine.runner import ModelRunner

    runner = ModelRunner(model, n_slots=1, max_len=len(prompt) + decode + 1, checkpoint_interval=0)
    runner.forward([0], [prompt[:8]])  # warm-up: first-call costs out of the figures
    runner.reset(0)
    began = time.perf_counter()
    logits = runner.forward([0], [prompt])
    prefill = time.perf_counter() - began
    began, before = time.perf_counter(), moved()
    for _ in range(decode):
        logits = runner.forward([0], [[int(torch.argmax(logits[0]))]])
    return dict(prefill_tok_s=len(prompt) / prefill, decode_tok_s=decode / (time.perf_counter() - began),
                bytes_per_token=(moved() - before) / decode)


def _rank(rank: int, args, port: int, out) -> None:
    import torch

    world = max(args.pp, args.tp)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world))
    from deltaserve.dist import join

    loaded = join(args.model, pp=args.pp, tp=args.tp, timeout_s=600)
    if loaded is not None:
        model, _ = loaded
        result = _measure(model, _prompt(args.prompt, model.config.vocab_size), args.decode,
                          lambda: model.link.bytes_sent + model.link.bytes_received)
        out.put((rank, result | dict(link_us_per_token=result["bytes_per_token"] * 8 / LINK_BITS_PER_S * 1e6)))
    out.put((rank, dict(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


def _single(args, out) -> None:
    import torch

    from deltaserve.engine.llm import load

    torch.set_num_threads(args.threads)
    model, _ = load(args.model)
    result = _measure(model, _prompt(args.prompt, model.config.vocab_size), args.decode)
    out.put((0, result | dict(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


def _prompt(n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(n)]


def _run(target, args, ranks: int, extra=()) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*((r,) if ranks > 1 else ()), args, *extra, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = [{} for _ in range(ranks)]
    for _ in range(ranks + (1 if ranks > 1 else 0)):
        rank, got = out.get(timeout=3600)
        results[rank] |= got
    for p in procs:
        p.join()
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.dist", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor shards instead (then give --pp 1)")
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    p.add_argument("--decode", type=int, default=64, help="decode steps (default 64)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads in all (default: every core)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = dict(model=args.model, threads=args.threads, load_average=os.getloadavg(),
                  single=_run(_single, args, 1)[0], pipeline=_run(_rank, args, max(args.pp, args.tp), (port,)))
    one, many = report["single"], report["pipeline"]
    print(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak RSS MB (per rank)':>26}")
    print(f"{'1 process':14}{one['prefill_tok_s']:15.1f}{one['decode_tok_s']:14.2f}{one['peak_rss_mb']:26.0f}")
    rss = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in many)
    split = f"--pp {args.pp}" if args.pp > 1 else f"--tp {args.tp}"
    print(f"{split:14}{many[0]['prefill_tok_s']:15.1f}{many[0]['decode_tok_s']:14.2f}{rss:>26}")
    what = "hidden states" if args.pp > 1 else "logit shards (the all-reduces, README's table, not counted)"
    print(f"decode: {many[0]['bytes_per_token']:.0f} bytes of {what} a token in and out of rank 0 (the "
          f"commands' few hundred bytes not counted); on a 10 Gb/s link {many[0]['link_us_per_token']:.1f} us a "
          f"token of transfer time, before each hop's latency. Load average {report['load_average'][0]:.2f} (a loaded machine "
          f"slows both alike).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
