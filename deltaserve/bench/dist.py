"""One process against N ranks on one machine, pipeline (--pp N) and tensor (--tp N) parallel: prefill and
decode tokens/s, bytes exchanged a token, what they would cost on a link between machines, peak RSS per rank,
and how busy each pipeline stage is.

    python -m deltaserve.bench.dist MODEL.gguf [--ranks 2] [--splits pp,tp] [--prompt 512] [--decode 64]
                                    [--batch 1] [--micro-batches 1,2] [--threads T] [--json out.json]

Every configuration runs in processes of its own (torch.multiprocessing, gloo over loopback), one after the
other: a single process with T threads, then N ranks with T / N threads each, so all use the same cores. A
split the model does not allow (--tp N must divide its head counts) is reported with the reason and skipped.
--batch B runs B sequences at once (B prompts prefilled in one pass, then B tokens a decode step), as
continuous batching does; --pp runs once for each number of micro-batches a pass is split into.

Bytes a token: --pp, the hidden states in and out of rank 0 (2 of the N hops); --tp, each rank's share of
the all-reduces as a ring moves it (2(N-1)/N of each summed tensor) plus the vocabulary shards gathered to
rank 0. The commands' few hundred bytes are not counted. A link's cost a token: those bytes at its bandwidth
plus its one-way latency for each message that waits on the one before (N hops a token for --pp; 2(N-1)
ring steps an all-reduce, two all-reduces a layer, for --tp). Stage busy: the share of the passes' wall time
(on rank 0) each pipeline rank spent running its own layers; the rest it waited, which micro-batching could
fill on separate machines.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import time

from deltaserve.bench import peak_rss_mb

LINK_BITS_PER_S = 10e9


def _measure(model, prompt: list[int], decode: int, batch: int = 1, moved=lambda: (0, 0),
             passes=lambda: 0) -> dict:
    """Warm up, prefill `batch` prompts (rotations of `prompt`) in one call, then `decode` steps of a token
    each. moved(): (bytes, sequential messages) exchanged so far; passes(): the stage clock's passes so far
    (pipeline)."""
    import torch

    from deltaserve.engine.runner import ModelRunner

    slots = list(range(batch))
    prompts = [prompt[i:] + prompt[:i] for i in slots]
    runner = ModelRunner(model, n_slots=batch, max_len=len(prompt) + decode + 1, checkpoint_interval=0)
    runner.forward(slots, [p[:8] for p in prompts])  # warm-up: first-call costs out of the figures
    for slot in slots:
        runner.reset(slot)
    marks = [passes()]
    (b0, _), began = moved(), time.perf_counter()
    logits = runner.forward(slots, prompts)
    prefill_s = time.perf_counter() - began
    (b1, m1), marks = moved(), marks + [passes()]
    began = time.perf_counter()
    for _ in range(decode):
        logits = runner.forward(slots, [[int(t)] for t in torch.argmax(logits, -1)])
    decode_s = time.perf_counter() - began
    b2, m2 = moved()
    tokens = batch * len(prompt), batch * decode
    return dict(prefill_tok_s=tokens[0] / prefill_s, decode_tok_s=tokens[1] / decode_s, prefill_s=prefill_s,
                decode_s=decode_s, prefill_bytes_per_token=(b1 - b0) / tokens[0],
                bytes_per_token=(b2 - b1) / tokens[1], messages_per_token=(m2 - m1) / decode,
                marks=marks + [passes()])


def _single(args, out) -> None:
    import torch

    from deltaserve.engine.llm import load

    torch.set_num_threads(args.threads)
    model, _ = load(args.model)
    result = _measure(model, _prompt(args.prompt, model.config.vocab_size), args.decode, args.batch)
    out.put((0, result | dict(peak_rss_mb=peak_rss_mb())))


def _rank(rank: int, args, split: str, micro: int, port: int, out) -> None:
    import torch

    from deltaserve.errors import DeltaserveError

    N = args.ranks
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(N), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // N))
    from deltaserve.dist import join
    from deltaserve.dist.pipeline import CLOCK

    try:
        loaded = join(args.model, **{split: N}, timeout_s=600)
    except DeltaserveError as e:  # the same on every rank: the model does not split so
        out.put((rank, dict(skipped=str(e), done=True)))
        return
    if loaded is not None:
        model, _ = loaded
        if split == "pp":  # N hops a micro-batch, one after the other
            model.micro_batches = micro
            def moved():  # N + m - 1 hops of m micro-batches wait on each other
                hops = N + min(micro, args.batch) - 1
                return model.link.bytes_sent + model.link.bytes_received, hops * len(CLOCK.passes)
        else:  # the gathered logits, and this rank's ring share of every all-reduce (2(N-1) steps each)
            def moved():
                p = model.part
                return model.link.bytes_received + 2 * (N - 1) / N * p.reduced, 2 * (N - 1) * p.reductions
        result = _measure(model, _prompt(args.prompt, model.config.vocab_size), args.decode, args.batch, moved,
                          lambda: len(CLOCK.passes))
        result["messages_per_token"] += split == "tp"  # the gather of the logits
        out.put((rank, result))
    out.put((rank, dict(peak_rss_mb=peak_rss_mb(), passes=list(CLOCK.passes), done=True)))


def _prompt(n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(n)]


def _run(target, args, ranks: int, extra=()) -> list[dict]:
    """Each of `ranks` processes' figures (dicts merged from what it put, until it said done)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*((r,) if ranks > 1 else ()), args, *extra, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results, done = [{} for _ in range(ranks)], 0
    while done < ranks:
        try:
            rank, got = out.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode for p in procs):  # a process that failed puts nothing more: its error is above
                raise SystemExit(f"a benchmark process failed (exit codes {[p.exitcode for p in procs]})")
            continue
        results[rank] |= got
        done += bool(got.pop("done", ranks == 1))
    for p in procs:
        p.join()
    for r in results:
        r.pop("done", None)
    return results


def _stage_busy(ranks: list[dict]) -> list[dict]:
    """Per pipeline rank, the share of rank 0's prefill and decode wall time it spent running its layers.
    Every rank keeps the same passes in the same order, so rank 0's marks cut every rank's list alike."""
    first, mid, end = ranks[0]["marks"]
    walls = dict(prefill=ranks[0]["prefill_s"], decode=ranks[0]["decode_s"])
    out = []
    for r in ranks:
        seconds = [s for _, s in r["passes"]]
        busy = dict(prefill=sum(seconds[first:mid]), decode=sum(seconds[mid:end]))
        out.append({k: busy[k] / walls[k] for k in walls})
    return out


def _link_us(bytes_per_token: float, messages: float, latency_us: float) -> float:
    return bytes_per_token * 8 / LINK_BITS_PER_S * 1e6 + messages * latency_us


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m deltaserve.bench.dist", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each split (default 2)")
    p.add_argument("--splits", default="pp,tp", help="which splits to run, of pp and tp (default both)")
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    p.add_argument("--decode", type=int, default=64, help="decode steps (default 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences run at once (default 1)")
    p.add_argument("--micro-batches", default="1",
                   help="--pp: the most micro-batches a pass is split into, a run for each (e.g. 1,2; default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads in all (default: every core)")
    p.add_argument("--latency-us", type=float, default=25.0,
                   help="one-way latency of the link whose cost is estimated (default 25 us, TCP on 10 GbE)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    splits = [s for s in args.splits.split(",") if s]
    if args.ranks < 2 or any(s not in ("pp", "tp") for s in splits):
        p.error("--ranks must be at least 2 and --splits a list of pp and tp")
    try:
        micro = [int(m) for m in args.micro_batches.split(",")]
    except ValueError:
        micro = []
    if not micro or min(micro) < 1 or args.batch < 1:
        p.error("--micro-batches must be a list of counts of at least 1, and --batch at least 1")
    runs = [(s, m) for s in splits for m in (micro if s == "pp" else [1])]
    report = dict(model=args.model, ranks=args.ranks, threads=args.threads, cpus=os.cpu_count(),
                  prompt=args.prompt, decode=args.decode, batch=args.batch, latency_us=args.latency_us,
                  runs=[_name(s, m, micro) for s, m in runs],
                  command=" ".join([sys.executable, "-m", "deltaserve.bench.dist", *sys.argv[1:]]),
                  load_average_before=os.getloadavg())
    report["single"] = _run(_single, args, 1)[0]
    for split, m in runs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = _run(_rank, args, args.ranks, (split, m, port))
        name = _name(split, m, micro)
        if "skipped" in ranks[0]:
            report[name] = dict(skipped=ranks[0]["skipped"])
            continue
        if split == "pp":
            ranks[0]["stage_busy"] = _stage_busy(ranks)
        for r in ranks:
            r.pop("passes", None)
        report[name] = dict(ranks=ranks)
    report["load_average_after"] = os.getloadavg()
    _print(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _name(split: str, m: int, micro: list[int]) -> str:
    """A run's key in the report: pp, tp, or pp/m2 where several micro-batch counts run."""
    return f"pp/m{m}" if split == "pp" and len(micro) > 1 else split


def _print(report: dict, args) -> None:
    N = args.ranks
    head = (f"{'':14}{'prefill tok/s':>14}{'decode tok/s':>13}{'bytes/token':>13}{'messages':>10}"
            f"{'10 Gb/s us/token':>18}{'peak RSS MB a rank':>20}{'stage busy prefill, decode':>28}")
    print(head)
    one = report["single"]
    print(f"{'1 process':14}{one['prefill_tok_s']:14.1f}{one['decode_tok_s']:13.2f}{'':13}{'':10}{'':18}"
          f"{one['peak_rss_mb']:20.0f}")
    for key in report["runs"]:
        split, _, m = key.partition("/")
        name = f"--{split} {N}" + (f" {m}" if m else "")
        if "skipped" in report[key]:
            print(f"{name:14}skipped: {report[key]['skipped']}")
            continue
        ranks = report[key]["ranks"]
        r0 = ranks[0]
        link = _link_us(r0["bytes_per_token"], r0["messages_per_token"], args.latency_us)
        rss = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in ranks)
        busy = ", ".join(" / ".join(f"{b[k]:.0%}" for b in r0["stage_busy"]) for k in ("prefill", "decode")) \
            if "stage_busy" in r0 else ""
        print(f"{name:14}{r0['prefill_tok_s']:14.1f}{r0['decode_tok_s']:13.2f}{r0['bytes_per_token']:13.0f}"
              f"{r0['messages_per_token']:10.0f}{link:18.1f}{rss:>20}{busy:>28}")
    la = report["load_average_before"], report["load_average_after"]
    prefill = [f"{k} {report[k]['ranks'][0]['prefill_bytes_per_token']:.0f}" for k in report["runs"]
               if "ranks" in report[k]]
    print(f"{args.batch} sequences at once; tokens/s count all of them. Prefill moves "
          f"{', '.join(prefill) or 'nothing'} bytes a prompt token. Link cost: bytes at 10 Gb/s plus {args.latency_us:g} us a sequential message. "
          f"{report['cpus']} CPUs, {args.threads} threads in all; load average {la[0][0]:.2f} before, "
          f"{la[1][0]:.2f} after (a loaded machine slows every configuration alike).")


if __name__ == "__main__":
    main()
