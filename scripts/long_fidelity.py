"""Last-token logits after a long prompt, deltaserve against llama.cpp (llama-cpp-python) on the same float32 file.

    python scripts/long_fidelity.py --preset tiny --tokens 131072
    python scripts/long_fidelity.py --preset 0.8b --tokens 32768 --file /tmp/q35-08b-f32.gguf

Makes the random-weight file when it is missing (deltaserve.convert.make_model), then runs each engine in
its own process on the same random prompt: deltaserve through its runner in 512-token passes (prefix
checkpoints on, within the default budget), llama.cpp with a float32 KV cache (as ours is beside float32
weights). Prints max|diff| / std of llama.cpp's logits (the suite holds 8k tokens to 5e-3 in
tests/models/test_long_context.py), each engine's prefill time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltaserve, run from anywhere


def prompt(path: str, n: int, seed: int = 0) -> list[int]:
    """n ids drawn from the file's normal tokens: a random-weight file keeps its placeholder tokens' embedding rows
    zero (convert/presets.py), and a prompt of those gives both engines all-zero logits, which agree trivially."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields["tokenizer.ggml.token_type"]
    normal = np.array([i for i, part in enumerate(field.data) if int(field.parts[part][0]) == 1])
    return normal[np.random.default_rng(seed).integers(0, len(normal), n)].tolist()


def ours(path: str, n: int, out: str) -> dict:
    import torch

    from deltaserve.engine.llm import LLM

    llm = LLM(path, max_len=n + 8, prefill_chunk=512)
    ids = prompt(path, n)
    t = time.perf_counter()
    for i in range(0, n, 512):
        logits = llm.runner.forward([0], [ids[i:i + 512]])
    np.save(out, logits[0].double().numpy())
    store = llm.runner.cache.store
    return {"seconds": time.perf_counter() - t, "checkpoint_mb": (store.nbytes if store else 0) / 1e6,
            "state_mb": llm.runner.cache.state.nbytes() / 1e6, "threads": torch.get_num_threads()}


def theirs(path: str, n: int, out: str) -> dict:
    from deltaserve.bench.llama_peer import open_llama

    f32 = 0  # GGML_TYPE_F32: the KV cache in float32, as deltaserve's beside float32 weights
    llm = open_llama(path, n_ctx=n + 8, n_batch=512, n_ubatch=512, type_k=f32, type_v=f32, verbose=False)
    ids = prompt(path, n)
    t = time.perf_counter()
    llm.eval(ids)
    np.save(out, np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64))
    return {"seconds": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arch", default="qwen35")
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--file", help="the float32 GGUF (default /tmp/{arch}-{preset}-f32.gguf; made if missing)")
    p.add_argument("--worker", nargs=4, metavar=("ENGINE", "PATH", "N", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        engine, path, n, out = args.worker
        result = (ours if engine == "deltaserve" else theirs)(path, int(n), out)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    path = Path(args.file or f"/tmp/{args.arch}-{args.preset}-f32.gguf")
    if not path.exists():
        from deltaserve.convert import make_model

        make_model(args.arch, args.preset, "f32", path, seed=3)
    logits, results = {}, {}
    for engine in ("deltaserve", "llama.cpp"):
        out = f"{path}.{engine}.{args.tokens}.npy"
        done = subprocess.run([sys.executable, __file__, "--worker", engine, str(path), str(args.tokens), out],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
        results[engine] = json.loads(done.stdout.strip().splitlines()[-1])
        logits[engine] = np.load(out)
        print(f"{engine}: {results[engine]}", flush=True)
    ref = logits["llama.cpp"]
    if not ref.std() > 0:
        raise SystemExit(f"llama.cpp's logits are constant ({ref[:3]}...): nothing to compare")
    diff = np.abs(logits["deltaserve"] - ref).max() / ref.std()
    print(f"{path.name}, {args.tokens} tokens: max|diff|/std {diff:.2e} "
          f"(argmax {int(logits['deltaserve'].argmax())} vs {int(ref.argmax())})")


if __name__ == "__main__":
    main()
