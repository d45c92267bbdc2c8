"""Last-token logits of a GGUF file, deltaserve against llama.cpp (llama-cpp-python), and their greedy tokens.

    python scripts/quant_fidelity.py FILE.gguf [--tokens 200] [--greedy 32] [--float-activations]

Both engines read the same random prompt of the file's normal tokens (a random-weight file's placeholder tokens
have zero embeddings). Prints max|diff| of the last-token logits over the std of llama.cpp's, the argmax of
each, and where the greedy continuations part, with llama.cpp's top-2 margin there (in the same std).
--float-activations keeps float32 activations in our integer-kernel matmuls (packed.INT8_ACTIVATIONS and
layers.Q8_INT8_ACTIVATIONS off), to see how far the activations' rounding alone moves the logits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltaserve, run from anywhere


def prompt(path: str, n: int, seed: int = 0) -> list[int]:
    from gguf import GGUFReader

    field = GGUFReader(path).fields["tokenizer.ggml.token_type"]
    normal = np.array([i for i, part in enumerate(field.data) if int(field.parts[part][0]) == 1])
    return normal[np.random.default_rng(seed).integers(0, len(normal), n)].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--greedy", type=int, default=32)
    p.add_argument("--float-activations", action="store_true")
    args = p.parse_args()
    from deltaserve.bench.llama_peer import open_llama
    from deltaserve.engine.llm import LLM
    from deltaserve.models import layers, packed

    if args.float_activations:
        packed.INT8_ACTIVATIONS = layers.Q8_INT8_ACTIVATIONS = False
    ids = prompt(args.model, args.tokens)
    ours = LLM(args.model, max_len=args.tokens + args.greedy + 8, checkpoint_interval=0)
    ref = open_llama(args.model, n_ctx=args.tokens + args.greedy + 8, n_batch=256, logits_all=True, verbose=False,
                     seed=0)

    def theirs(tokens: list[int]) -> np.ndarray:
        ref.reset()
        ref.eval(tokens)
        return np.asarray(ref.scores[len(tokens) - 1], dtype=np.float64)

    mine, last = ours.score(ids)[-1].double().numpy(), theirs(ids)
    print(f"{args.model}: {args.tokens}-token prompt, last-token max|diff|/std {np.abs(mine - last).max() / last.std():.2e} "
          f"(std {last.std():.3g}), argmax {mine.argmax()} vs {last.argmax()}")
    a = ours.generate(ids, max_tokens=args.greedy, temperature=0, ignore_eos=True).token_ids
    b = []
    for _ in range(args.greedy):
        b.append(int(theirs(ids + b).argmax()))
    parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if parted is None:
        print(f"{args.greedy} greedy tokens identical")
    else:
        top = np.sort(theirs(ids + b[:parted]))
        print(f"greedy parts at token {parted}; llama.cpp's top-2 margin there {(top[-1] - top[-2]) / top.std():.2e} std")
    ref.close()


if __name__ == "__main__":
    main()
