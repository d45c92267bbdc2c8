"""Benchmark of every gated-delta-rule path beside the peers, measured in the same run.

    python -m deltaserve.bench.ops [--json out.json] [--T 1 64 512 4096] [--heads 16 32]

Prints tokens/s per layer (one sequence, K = V = 128, float32 state) for each path and for transformers'
torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (a plain per-token loop), plus
microseconds per step at T = 1 (decode).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from deltaserve.ops import fused, gated_delta_rule


def _peers():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return {}
    return {"hf_chunk": m.torch_chunk_gated_delta_rule, "hf_loop": m.torch_recurrent_gated_delta_rule}


def _time(fn, budget_s: float) -> float:
    """Median seconds per call: warm-up calls for a tenth of the budget (at least one: threads wake,
    caches fill), then repeats until the budget is spent (at least 3 calls, at most 10,000)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < budget_s / 10:
        fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 10_000):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def run(Ts, heads, budget_s=1.0, K=128, V=128):
    paths = ["fused", "chunk", "recurrent", "reference"] if fused.available() else ["chunk", "recurrent", "reference"]
    peers = _peers()
    rows = []
    for HV in heads:
        for T in Ts:
            gen = torch.Generator().manual_seed(0)
            q, k = (torch.randn(1, T, HV, K, generator=gen) for _ in range(2))
            v = torch.randn(1, T, HV, V, generator=gen)
            g = -torch.rand(1, T, HV, generator=gen) * 0.1
            beta = torch.rand(1, T, HV, generator=gen)
            state = torch.zeros(1, HV, K, V)
            row = {"T": T, "HV": HV}
            for path in paths:
                if path == "reference" and T * HV > 64 * 32:
                    row[path] = None  # the float64 spec loop takes minutes here; it is a spec, not a contender
                    continue
                s = _time(lambda: gated_delta_rule(q, k, v, g, beta, initial_state=state, inplace=True,
                                                   use_qk_l2norm=True, backend=path), budget_s)
                row[path] = s
            for name, fn in peers.items():
                s = _time(lambda: fn(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True), budget_s)
                row[name] = s
            rows.append(row)
            _print_row(row, paths + list(peers))
    return {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "K": K, "V": V, "seconds_per_call": rows}


def _print_row(row, cols):
    if not getattr(_print_row, "header", False):
        print(f"{'HV':>3} {'T':>5} | " + " | ".join(f"{c:>12}" for c in cols) + "   (tokens/s; T=1: us/step)")
        _print_row.header = True
    cells = []
    for c in cols:
        s = row.get(c)
        if s is None:
            cells.append(f"{'-':>12}")
        elif row["T"] == 1:
            cells.append(f"{s * 1e6:>10.1f}us")
        else:
            cells.append(f"{row['T'] / s:>12,.0f}")
    print(f"{row['HV']:>3} {row['T']:>5} | " + " | ".join(cells), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="deltaserve bench ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[1, 64, 512, 4096], help="sequence lengths")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 32], help="value heads (H = HV)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per cell")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args(argv)
    result = run(args.T, args.heads, args.budget)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
