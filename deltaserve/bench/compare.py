"""deltaserve beside llama.cpp on the same GGUF, measured in one run.

    python -m deltaserve.bench.compare MODEL.gguf [--against llama.cpp|none] [--reps 3] [--json out.json]
    deltaserve bench MODEL.gguf --against llama.cpp
    deltaserve bench MODEL.gguf --against llama.cpp --prompt 512,8192,32768   (as the context grows: context.py)

Each engine runs in its own worker process (so its peak RSS is its own), alternating, for several
repetitions. Measured: prefill tokens/s at 512 and 2048 prompt tokens, decode tokens/s (64 greedy tokens
after a 512-token prompt), peak RSS, and that peak less the RSS after each engine's imports (the interpreter
with torch, or with llama-cpp-python: a fixed cost that dominates small files); the table shows medians and the
ratios deltaserve / llama.cpp. Below it:
which of our decode kernels read how much of the weights, the GB/s our decode GEMVs alone stream them at
(a token through every matmul weight), the machine's memory bandwidth by a 1 GiB torch copy, and the matmul
kernels' rates beside this machine's peaks measured in the same run (bench/kernels.py). Last, both engines loaded
at once decode in alternating rounds (bench/rounds.py): a ratio from the same seconds of a shared host, whose
memory rate moves between the repetitions.
Both do the same work: llama-cpp-python's Llama keeps no prefix states (without a LlamaCache), so
deltaserve's prefix checkpoints are off unless --cache-mb gives them a budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from deltaserve.bench import llama_peer, peak_rss_mb, rounds


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt of n token ids (both engines get the same ids)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(min(vocab, 30000) // 4, min(vocab, 30000)) for _ in range(n)]


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt takes comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--prompt lengths must be >= 1, got {text!r}")
    return lengths


def _worker_deltaserve(args) -> dict:
    import torch

    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import argmax_rows

    imported = peak_rss_mb()  # the interpreter, torch and our modules, before the model
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, max_len=max(args.prefill + [512]) + args.decode + 8, prefill_chunk=args.batch, dtype=dtype,
              cache_budget_mb=args.cache_mb)
    vocab = llm.model.config.vocab_size
    runner, out = llm.runner, {"import_rss_mb": imported}

    def prefill(ids):
        runner.reset(0)
        t = time.perf_counter()
        for i in range(0, len(ids), args.batch):
            logits = runner.forward([0], [ids[i:i + args.batch]])
        return time.perf_counter() - t, logits

    prefill(_prompt(32, vocab))  # warm-up: kernel build, allocator
    for n in args.prefill:
        out[f"prefill_{n}"] = n / prefill(_prompt(n, vocab))[0]
    _, logits = prefill(_prompt(512, vocab))
    t = time.perf_counter()
    for _ in range(args.decode):
        token = argmax_rows(logits[:1])[0]  # (numpy's, as the llama.cpp worker's below)
        logits = runner.forward([0], [[token]])
    out["decode"] = args.decode / (time.perf_counter() - t)
    out["kernels"] = _kernels(llm.model)
    out["peak_rss_mb"] = peak_rss_mb()  # before the read buffer below
    out |= _gemv_gbps(llm.model)
    return out


def _matmul_weights(model) -> list:
    """The weights a decode step streams through linear(): every Linear's and the output head's (the tied
    embedding where there is no lm_head). MoE experts are left out: a token reads only its top-k."""
    from deltaserve.models.layers import Linear

    head = model.embed.weight if model.lm_head is None else None
    return [m.weight for m in model.modules() if isinstance(m, Linear)] + ([head] if head is not None else [])


def _kernels(model) -> str:
    """Which decode kernel reads how many MB of the weights, by storage form."""
    import torch

    from deltaserve.models import packed
    from deltaserve.models.layers import q8_int8

    names = {"uint8": "linear_packed", "int8": "linear_q8", "float16": "linear_f16", "bfloat16": "linear_bf16"}
    mb, types = {}, {}
    for w in _matmul_weights(model):
        kernel = names.get(str(w.dtype).removeprefix("torch."), f"torch ({str(w.dtype).removeprefix('torch.')})")
        if packed.is_packed(w) and packed.uses_int8(w):
            kernel = "linear_int8"
        elif w.dtype == torch.int8 and q8_int8(torch.empty(0, w.shape[-1])):
            kernel = "linear_q8_int8"
        mb[kernel] = mb.get(kernel, 0) + w.nbytes / 1e6
        if packed.is_packed(w):
            types.setdefault(kernel, set()).update(t.name for t, _ in w.packing.segments)
    return ", ".join(f"{k} {v:,.0f} MB" + (f" ({'/'.join(sorted(types[k]))})" if k in types else "")
                     for k, v in sorted(mb.items(), key=lambda kv: -kv[1]))


def _gemv_gbps(model, passes: int = 7) -> dict:
    """GB/s at which the decode GEMVs alone stream the weights (one token through every matmul weight, timed: the
    best pass), and their share of the memory's read rate measured beside them: after each pass, as many bytes read
    by a plain pass over a buffer 4x the L3 (ops read_sum, timed the same way). This host's memory rate moves minute
    to minute, so the share is taken pair by pair (their median), not against a peak measured at another time."""
    import torch

    from deltaserve.bench.kernels import stream_bytes
    from deltaserve.loader.memory import weight_empty
    from deltaserve.models import packed
    from deltaserve.models.layers import linear
    from deltaserve.ops import fused

    weights = _matmul_weights(model)
    inputs = [torch.randn(1, w.packing.shape[-1] if packed.is_packed(w) else w.shape[-1]) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    buf = weight_empty((min(nbytes, stream_bytes()) // 256 * 256,), torch.uint8).fill_(1)  # 2 MB pages, as weights
    reads = -(-nbytes // buf.numel())
    gemv, read = [], []
    for _ in range(passes):
        t = time.perf_counter()
        for w, x in zip(weights, inputs):
            linear(x, w)
        gemv.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        for _ in range(reads):
            fused.extension().read_sum(buf)
        read.append(reads * buf.numel() / (time.perf_counter() - t) / 1e9)
    return {"gemv_gbps": max(gemv), "read_beside_gbps": statistics.median(read),
            "gemv_share": statistics.median(g / r for g, r in zip(gemv, read))}


def _worker_bandwidth(args) -> dict:
    """This machine's memory bandwidth as torch sees it: copies of a 1 GiB tensor, bytes read + written."""
    import torch

    torch.set_num_threads(args.threads)
    a = torch.ones(1 << 28)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return {"copy_gbps": 2 * a.nbytes / best / 1e9}


def _worker_kernels(args) -> dict:
    from deltaserve.bench import kernels

    return kernels.report(args.threads)


def _worker_llama(args) -> dict:
    import llama_cpp  # noqa: F401 (imported here so that its share of the RSS is measured apart from the model's)
    import numpy as np

    imported = peak_rss_mb()
    llm = llama_peer.open_llama(args.model, n_ctx=max(args.prefill + [512]) + args.decode + 8, n_batch=args.batch,
                                n_ubatch=args.batch, n_threads=args.threads, n_threads_batch=args.threads,
                                verbose=False)
    vocab, out = llm.n_vocab(), {"import_rss_mb": imported}

    def prefill(ids):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t

    prefill(_prompt(32, vocab))
    for n in args.prefill:
        out[f"prefill_{n}"] = n / prefill(_prompt(n, vocab))
    prefill(_prompt(512, vocab))
    t = time.perf_counter()
    for _ in range(args.decode):  # without logits_all, the last logits live only in the context
        token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
        llm.eval([token])
    out["decode"] = args.decode / (time.perf_counter() - t)
    return out


def _run_worker(engine: str, args) -> dict:
    model = args.peer_model if engine == "llama.cpp" and args.peer_model else args.model
    cmd = [sys.executable, "-m", "deltaserve.bench.compare", model, "--worker", engine, "--threads",
           str(args.threads), "--batch", str(args.batch), "--decode", str(args.decode), "--dtype", args.dtype,
           "--cache-mb", str(args.cache_mb),
           "--prefill", *map(str, args.prefill)]
    env = dict(os.environ, DELTASERVE_NO_PROGRESS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(args, engines: list[str], runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Prints the medians of the workers' runs per metric (and the ratio deltaserve / llama.cpp), the RSS past
    each engine's imports among them; returns the medians."""
    for run in (r for e in engines for r in runs[e]):
        run["rss_past_imports_mb"] = run["peak_rss_mb"] - run["import_rss_mb"]
    metrics = [f"prefill_{n}" for n in args.prefill] + ["decode", "peak_rss_mb", "rss_past_imports_mb"]
    median = {e: {m: statistics.median(r[m] for r in runs[e]) for m in metrics} for e in engines}
    print(f"\n{os.path.basename(args.model)}, {args.threads} threads, median of {args.reps}")
    names = {m: m + (" MB" if m.endswith("_mb") else " tok/s") for m in metrics}
    width = max(map(len, names.values())) + 1
    print(f"{'metric':<{width}}" + "".join(f"{e:>14}" for e in engines) + ("       ratio" if len(engines) > 1 else ""))
    for m in metrics:
        row = f"{names[m]:<{width}}" + "".join(f"{median[e][m]:>14,.1f}" for e in engines)
        if len(engines) > 1:
            row += f"{median['deltaserve'][m] / median['llama.cpp'][m]:>11.2f}x"
        print(row)
    print("peak RSS after the imports, before the model: " + ", ".join(
        f"{e} {statistics.median(r['import_rss_mb'] for r in runs[e]):,.1f} MB" for e in engines) +
        " (deltaserve's is the interpreter with torch: rss_past_imports_mb sets it aside)")
    return median


def main(argv=None):
    p = argparse.ArgumentParser(prog="deltaserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a GGUF file (or a Hugging Face directory, with --peer-model)")
    p.add_argument("--peer-model", help="the GGUF file llama.cpp runs where `model` is a Hugging Face directory of "
                                        "the same weights (default: model itself)")
    p.add_argument("--against", choices=["llama.cpp", "none"], default="llama.cpp", help="peer (default llama.cpp)")
    p.add_argument("--reps", type=int, help="repetitions per engine, alternating (default 3; 1 with --prompt)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both engines (default: all)")
    p.add_argument("--batch", type=int, default=512, help="prefill batch / chunk for both engines (default 512)")
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths (default 512 2048)")
    p.add_argument("--decode", type=int, help="decode tokens after a 512-token prompt (default 64; with --prompt, "
                                               "after each prompt, 16)")
    p.add_argument("--prompt", type=_lengths, help="prompt lengths, comma-separated: prefill, decode at that context "
                                                   "and peak RSS per length, each engine with its default settings")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="deltaserve compute dtype")
    p.add_argument("--cache-mb", type=float, default=0.0,
                   help="deltaserve's prefix-checkpoint budget (default 0: off, as llama-cpp-python's Llama keeps "
                        "no prefix states without a LlamaCache, so both engines do the same work)")
    p.add_argument("--rounds", type=int, default=8, help="then decode both engines loaded at once, alternating this "
                                                        "many rounds (bench/rounds.py; default 8, 0: skip)")
    p.add_argument("--round-tokens", type=int, default=16, help="decode tokens per round (default 16)")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--worker", choices=["deltaserve", "llama.cpp", "bandwidth", "kernels"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompt and not args.worker:
        from deltaserve.bench import context

        args.reps, args.decode = args.reps or 1, args.decode or 16
        context.run(args)
        return
    args.reps, args.decode = args.reps or 3, args.decode or 64

    if args.worker:
        workers = {"deltaserve": _worker_deltaserve, "llama.cpp": _worker_llama, "bandwidth": _worker_bandwidth,
                   "kernels": _worker_kernels}
        result = workers[args.worker](args)
        result.setdefault("peak_rss_mb", peak_rss_mb())
        print(json.dumps(result))
        return

    engines = ["deltaserve"] + (["llama.cpp"] if args.against == "llama.cpp" else [])
    runs = {e: [] for e in engines}
    for rep in range(args.reps):
        for engine in engines:
            runs[engine].append(_run_worker(engine, args))
            print(f"rep {rep + 1}/{args.reps} {engine}: {runs[engine][-1]}", file=sys.stderr, flush=True)
    median = _table(args, engines, runs)
    peer_note = llama_peer.note() if "llama.cpp" in engines else None
    if peer_note:
        print(peer_note)
    paired = None
    if "llama.cpp" in engines and args.rounds > 0:
        paired = rounds.decode_rounds({"deltaserve": args.model, "llama.cpp": args.peer_model or args.model},
                                      args.threads, args.rounds, args.round_tokens, args.dtype)
        print(rounds.format_rounds(paired, args.rounds, args.round_tokens))
    gemv, read, share = (statistics.median(r[k] for r in runs["deltaserve"])
                         for k in ("gemv_gbps", "read_beside_gbps", "gemv_share"))
    copy = _run_worker("bandwidth", args)["copy_gbps"]
    print(f"deltaserve decode kernels: {runs['deltaserve'][-1]['kernels']}")
    print(f"deltaserve decode GEMVs alone: {gemv:,.1f} GB/s of weights; a plain read beside each pass: {read:,.1f} "
          f"GB/s, the GEMVs at {share:.0%} of it; a 1 GiB torch copy here: {copy:,.1f} GB/s (read + write)")
    from deltaserve.bench.kernels import format_report

    kern = _run_worker("kernels", args)
    print(format_report(kern))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "runs": runs, "median": median,
                       "copy_gbps": copy, "kernels": kern, "peer_note": peer_note, "decode_rounds": paired}, f,
                      indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
