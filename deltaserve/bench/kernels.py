"""The matmul kernels' rates beside this machine's own peaks, measured in the same run.

    python -m deltaserve.bench.kernels [--threads N] [--json out.json]
    deltaserve bench kernels

Peaks (ops/csrc/probe.h): float32 FMAs, int8 and bf16 dot products with 12 independent chains a thread (and AMX
tiles' tdpbf16ps and tdpbsud where this CPU runs them: four independent tile sums a thread), memory reads of a
buffer 4x the L3 the OS reports, in 2 MB pages (as a model's weights). Kernels, per weight format, at a 0.8B model's
shapes: the decode GEMV (one row of activations, weights streamed from memory: GB/s of whole calls against a plain
read of as many bytes after each call) and the prefill GEMM (256 rows: GOP/s against the int8 or
FMA peak); the float16 GEMM (256 and 512 rows: GFLOP/s against the FMA peak) and torch's float32 GEMM beside them.
Each figure comes from the fastest of many short timings: on a shared machine other processes only ever slow one
down, and a call of a few ms often runs whole between them. The float16 GEMM's rate is taken as the peaks are, each
thread's fastest unit of its share (ops/csrc/shares.h) added up, with the whole calls' rate beside it (what a step
waits for, the scheduler's delays included); the decode GEMVs' threads' own shares are printed beside their whole
calls.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from deltaserve.loader.memory import weight_empty
from deltaserve.models import packed
from deltaserve.ops import fused

_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,),
           Q.Q4_0: (0,)}  # byte offsets of a block's float16 scales
_HIDDEN, _ROWS = 1024, 6144  # the 0.8B shapes: hidden size, a fused projection's output rows


def _best(fn, reps: int = 30) -> float:
    """The shortest of `reps` timings of fn() (after one warm-up): calls are kept short (a few ms at most) so that
    some of them run without being preempted on a machine shared with other jobs."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _fastest_pair(calls, others, share: float = 0.2) -> tuple[float, float]:
    """Mean times of the fastest `share` of calls and of others, run in turn, each call followed by its other (each
    timed alone: distinct data, so none hits the cache another left warm; pairs seconds apart, so that both sides
    see the same minutes of a shared host)."""
    times: tuple[list, list] = ([], [])
    for pair in zip(calls, others):
        for side, call in zip(times, pair):
            t = time.perf_counter()
            call()
            side.append(time.perf_counter() - t)
    fastest = [sorted(side)[:max(1, int(len(side) * share))] for side in times]
    return sum(fastest[0]) / len(fastest[0]), sum(fastest[1]) / len(fastest[1])


def _thread_rate(calls, row_bytes: float, share: float = 0.2) -> float | None:
    """Bytes per second of a decode GEMV as the read peak is measured (probe.h): each thread's rate (its rows over its
    own seconds, from calls returning [(rows, seconds)] per thread) over its fastest `share` of calls, added up (the
    single fastest would be an outlier: a matrix the L3 still held part of); None where the kernel reports no shares
    (builds without the timed kernels)."""
    rates: dict[int, list[float]] = {}
    for call in calls:
        for thread, (rows, seconds) in enumerate(call()):
            if rows and seconds > 0:
                rates.setdefault(thread, []).append(rows * row_bytes / seconds)
    fastest = [sorted(r, reverse=True)[:max(1, int(len(r) * share))] for r in rates.values()]
    return sum(sum(f) / len(f) for f in fastest) or None


def _l3_bytes(cache: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The L3's size as the OS reports it (a virtual machine is often shown its host's whole L3), 32 MB where it
    reports none."""
    for index in sorted(cache.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            continue
    return 32 << 20


def stream_bytes() -> int:
    """Bytes the decode rows cycle through and the read peak reads: 4x the L3, so that nothing read comes from a
    cache (one Xeon here reports a 480 MB L3, from which 128 MB of weights streamed at 1.7x memory's rate), at least
    128 MB and at most an eighth of the RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(128 << 20, 4 * _l3_bytes()), ram // 8))


def _count(matrix_bytes: int, stream: int) -> int:
    """How many distinct matrices of matrix_bytes the decode rows cycle through: stream bytes in all."""
    return max(1, stream // matrix_bytes)


def peaks(stream: int) -> dict:
    """float32 FMA GFLOP/s, int8 dot-product GOP/s, bf16 dot-product GFLOP/s and memory read GB/s (of a buffer of
    stream bytes) on all of torch's threads (each thread's fastest round, added up: see ops/csrc/probe.h)."""
    ext = fused.extension()
    mb = stream >> 20
    buf = weight_empty((mb << 20,), torch.uint8).fill_(1)  # in 2 MB pages as the weights are
    # each thread reads the first half of its share at most, which the fill left longest ago (the L3 holds its end)
    return {"fma_gflops": ext.probe_fma(20_000, 200) / 1e9, "int8_gops": ext.probe_int8(20_000, 200) / 1e9,
            "bf16_gflops": ext.probe_bf16(20_000, 200) / 1e9, "amx_bf16_gflops": ext.probe_amx_bf16(5_000, 50) / 1e9,
            "amx_int8_gops": ext.probe_amx_int8(5_000, 50) / 1e9,
            "read_gbps": ext.probe_read(buf, min(256, mb // 2 // torch.get_num_threads())) / 1e9}


def _matrix(qtype: Q, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A packed [N, K] matrix of random codes with small finite scales, held as a model holds it (row panels
    where the kernels read those)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(N * K // block, size), dtype=np.uint8)
    for at in _SCALES[qtype]:
        raw[:, at:at + 2] = np.full(raw.shape[0], 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    data = weight_empty((raw.size,), torch.uint8).copy_(torch.from_numpy(raw.reshape(-1)))  # 2 MB pages, as a model's
    return packed.to_panels(packed.parameter(data, packed.Packing(((qtype, N),), (N, K))))


def kernel_rates(stream: int) -> list[dict]:
    """Rows of (kernel, format, shape, seconds, rate, unit, peak key) for the decode GEMV (its matrices stream bytes
    in all) and prefill GEMM."""
    ext, rows = fused.extension(), []
    M, N = 256, _HIDDEN  # a prefill GEMM of a few ms (longer calls are preempted on a shared machine)
    for qtype in sorted(t for t in _SCALES if t in packed.int8_types()):
        # decode: matrices in turn, 4x the L3 in all, so the weights come from memory as in a model
        mats = [_matrix(qtype, _ROWS, _HIDDEN, seed=i) for i in range(_count(_ROWS * _HIDDEN // 2, stream))]
        x, y = torch.randn(1, _HIDDEN), torch.empty(1, _ROWS)
        shares = _thread_rate([lambda w=w: ext.linear_int8_shares(x, w, w.packing.table, y) for w in mats * 3],
                              mats[0].nbytes / _ROWS)
        calls = [lambda w=w: ext.linear_int8(x, w, w.packing.table, y) for w in mats * 3]
        rows.append(_decode_row("linear_int8 decode", qtype.name, calls, mats[0].nbytes, shares, stream))
        w = _matrix(qtype, N, _HIDDEN)
        xs, ys = torch.randn(M, _HIDDEN), torch.empty(M, N)
        prefill = _prefill_rows(ext, "linear_int8", qtype.name, lambda: ext.linear_int8(xs, w, w.packing.table, ys),
                                M, N, "GOP/s", "int8_gops", "amx_int8_gops")
        # its blocks' scales and products alone (K-quants and IQ4_XS; 0 where vpdpbusd does not run)
        bound = ext.probe_int8_format(300, 200, int(qtype)) / 1e9 if GGML_QUANT_SIZES[qtype][0] == 256 else 0
        for row in prefill:
            if row["peak"] == "int8_gops" and bound:
                row["format_bound"] = bound
        rows += prefill
    if ext.q8_int8():
        rows += _q8_rates(ext, M, N, stream)
    rows += _bf16_rates(ext, M, N, stream)
    rows += [_f16_decode_row(ext, stream), _f16_row(ext, M, N), _f16_row(ext, 2 * M, _ROWS)]
    a, b = torch.randn(M, _HIDDEN), torch.randn(N, _HIDDEN)
    t = _best(lambda: torch.mm(a, b.T))
    # torch's GEMM takes this CPU's widest ISA whatever DELTASERVE_MARCH built ours for (unless MKL is held to it
    # by MKL_ENABLE_INSTRUCTIONS): only a native build's FMA peak bounds it
    native = os.environ.get("DELTASERVE_MARCH", "native") == "native"
    rows.append(dict(kernel="torch.mm prefill", format="F32", shape=f"{M}x{N}x{_HIDDEN}", seconds=t,
                     rate=2 * M * N * _HIDDEN / t / 1e9, unit="GFLOP/s", peak="fma_gflops" if native else None))
    return rows


def _decode_row(kernel: str, fmt: str, calls: list, nbytes: int, thread_rate: float | None, stream: int) -> dict:
    """A decode GEMV's row: its whole calls' rate (what a decode step waits) against a plain read of as many bytes
    (ops read_sum, all threads) timed call by call between them, with the threads' own shares added up beside it (the
    kernel alone, where it times them). The host's memory rate moves from one minute to the next (plain reads of
    32-94 GB/s in one session on the Zen 5), and the read peak's fastest 1 MB rounds are bursts no whole call sustains
    (about twice a whole pass's rate, once): each GEMV call is followed by a read of its size, from a buffer 4x the L3,
    and each side's rate is the mean of its fastest fifth."""
    nb = nbytes // 256 * 256
    pieces = weight_empty((max(1, stream // nb) * nb,), torch.uint8).fill_(1).view(-1, nb)
    ext = fused.extension()
    reads = [lambda p=p: ext.read_sum(p) for p in pieces]
    gemv, read = _fastest_pair(calls, [reads[i % len(reads)] for i in range(len(calls))])
    return dict(kernel=kernel, format=fmt, shape=f"1x{_ROWS}x{_HIDDEN}", seconds=gemv, rate=nbytes / gemv / 1e9,
                shares_rate=thread_rate / 1e9 if thread_rate else None, unit="GB/s", peak="read_beside",
                read_beside=nb / read / 1e9)


def peak_of(row: dict, peaks: dict) -> float:
    """The rate a row is measured against: its own read beside (decode rows) or one of the machine's peaks."""
    return row[row["peak"]] if row["peak"] in row else peaks[row["peak"]]


def _q8_matrix(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A Q8_0 [N, K] weight (int8 + float16 scales, as layers.quantize_q8 keeps a Q8_0 file's) of random codes."""
    rng = np.random.default_rng(seed)
    w = weight_empty((N, K), torch.int8).copy_(torch.from_numpy(rng.integers(-127, 128, size=(N, K), dtype=np.int8)))
    w.scale = torch.full((N, K // 32), 0.01, dtype=torch.float16)
    return w


def _q8_rates(ext, M: int, N: int, stream: int) -> list[dict]:
    """The Q8_0 integer kernels at the same shapes as the K-quants'."""
    mats = [_q8_matrix(_ROWS, _HIDDEN, seed=i) for i in range(_count(_ROWS * _HIDDEN, stream))]
    x, y = torch.randn(1, _HIDDEN), torch.empty(1, _ROWS)
    nbytes = mats[0].numel() * 34 // 32
    shares = _thread_rate([lambda w=w: ext.linear_q8_int8_shares(x, w, w.scale, y) for w in mats * 3], nbytes / _ROWS)
    calls = [lambda w=w: ext.linear_q8_int8(x, w, w.scale, y) for w in mats * 3]
    out = [_decode_row("linear_q8_int8 decode", "Q8_0", calls, nbytes, shares, stream)]
    w = _q8_matrix(N, _HIDDEN)
    xs, ys = torch.randn(M, _HIDDEN), torch.empty(M, N)
    return out + _prefill_rows(ext, "linear_q8_int8", "Q8_0", lambda: ext.linear_q8_int8(xs, w, w.scale, ys), M, N,
                               "GOP/s", "int8_gops", "amx_int8_gops")


def _bf16_rates(ext, M: int, N: int, stream: int) -> list[dict]:
    """The bfloat16 kernels (ops/csrc/bf16.h) at the same shapes: GEMM against the bf16 dot-product peak (vdpbf16ps,
    or the FMA peak where the build widens the weights instead)."""
    def matrix(rows: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return weight_empty((rows, _HIDDEN), torch.bfloat16).copy_(torch.randn(rows, _HIDDEN, generator=g) * 0.05)

    mats = [matrix(_ROWS, i) for i in range(_count(_ROWS * _HIDDEN * 2, stream))]
    x, y = torch.randn(1, _HIDDEN), torch.empty(1, _ROWS)
    shares = _thread_rate([lambda w=w: ext.linear_bf16_shares(x, w, y, True) for w in mats * 3], 2 * _HIDDEN)
    calls = [lambda w=w: ext.linear_bf16(x, w, y, True) for w in mats * 3]
    out = [_decode_row("linear_bf16 decode", "BF16", calls, mats[0].nbytes, shares, stream)]
    w, xs, ys = matrix(N, 0), torch.randn(M, _HIDDEN), torch.empty(M, N)
    return out + _prefill_rows(ext, "linear_bf16", "BF16", lambda: ext.linear_bf16(xs, w, ys, True), M, N, "GFLOP/s",
                               "bf16_gflops", "amx_bf16_gflops")


def _prefill_rows(ext, kernel: str, fmt: str, call, M: int, N: int, unit: str, peak: str, amx_peak: str) -> list[dict]:
    """A prefill GEMM's row (M x N x _HIDDEN, call() runs it), and where AMX runs its tiles' row first (against the
    tiles' peak), the registers' path beside it on the same machine."""
    amx, out = ext.amx_enabled(), []
    try:
        for tiles in ([True, False] if amx else [False]):
            ext.set_amx(tiles)
            t = _best(call)
            out.append(dict(kernel=f"{kernel} prefill" + (" AMX" if tiles else ""), format=fmt,
                            shape=f"{M}x{N}x{_HIDDEN}", seconds=t, rate=2 * M * N * _HIDDEN / t / 1e9, unit=unit,
                            peak=amx_peak if tiles else peak))
    finally:
        ext.set_amx(amx)
    return out


def _f16_decode_row(ext, stream: int) -> dict:
    """The float16 decode GEMV (ops/csrc/gemv.h: float32 activations, weights widened in registers)."""
    mats = [(torch.randn(_ROWS, _HIDDEN) * 0.05).half() for _ in range(_count(_ROWS * _HIDDEN * 2, stream))]
    x, y = torch.randn(1, _HIDDEN), torch.empty(1, _ROWS)
    shares = _thread_rate([lambda w=w: ext.linear_f16_shares(x, w, y) for w in mats * 3], 2 * _HIDDEN)
    calls = [lambda w=w: ext.linear_f16(x, w, y) for w in mats * 3]
    return _decode_row("linear_f16 decode", "F16", calls, mats[0].nbytes, shares, stream)


def _f16_row(ext, M: int, N: int) -> dict:
    """The float16 prefill GEMM (ops/csrc/f16gemm.h): its rate as the FMA peak's is measured, each thread's fastest
    unit (a block of 256 columns: outputs times 2K flops over its own seconds) added up, with the whole calls' rate
    beside it."""
    w, x, y = (torch.randn(N, _HIDDEN) * 0.05).half(), torch.randn(M, _HIDDEN), torch.empty(M, N)
    flops = 2 * M * N * _HIDDEN
    t = _best(lambda: ext.linear_f16_gemm(x, w, y))
    shares = _thread_rate([lambda: ext.linear_f16_gemm_shares(x, w, y)] * 20, 2 * _HIDDEN)
    return dict(kernel="linear_f16_gemm prefill", format="F16", shape=f"{M}x{N}x{_HIDDEN}", seconds=t,
                rate=(shares or flops / t) / 1e9, wall_rate=flops / t / 1e9, unit="GFLOP/s", peak="fma_gflops")


def report(threads: int, stream_mb: int | None = None) -> dict:
    """The peaks and kernels' rows on `threads` threads, the decode rows and the read peak streaming stream_mb MB
    (stream_bytes() by default)."""
    torch.set_num_threads(threads)
    stream = stream_mb << 20 if stream_mb else stream_bytes()
    return {"threads": threads, "isa": fused.extension().int8_isa(), "stream_mb": stream >> 20, "peaks": peaks(stream),
            "kernels": kernel_rates(stream)}


def format_report(r: dict) -> str:
    p = r["peaks"]
    lines = [f"kernels ({r['threads']} threads; integer kernels: {r['isa']})",
             f"  peaks measured now: float32 FMA {p['fma_gflops']:,.0f} GFLOP/s, int8 dot {p['int8_gops']:,.0f} GOP/s, "
             f"bf16 dot {p['bf16_gflops']:,.0f} GFLOP/s, "
             + (f"AMX tiles bf16 {p['amx_bf16_gflops']:,.0f} GFLOP/s and int8 {p['amx_int8_gops']:,.0f} GOP/s, "
                if p.get("amx_bf16_gflops") else "")
             + f"memory read {p['read_gbps']:,.1f} GB/s (decode rows and reads of {r['stream_mb']:,} MB)"]
    for k in r["kernels"]:
        wall, shares = k.get("wall_rate"), k.get("shares_rate")
        beside = (f"  (whole calls: {wall:,.1f}, {wall / peak_of(k, p):.0%})" if wall and wall != k["rate"] else
                  f"  (threads' shares: {shares:,.1f})" if shares else "")
        share = (f"{k['rate'] / peak_of(k, p):6.0%} of a read beside" if k["peak"] == "read_beside" else
                 f"{k['rate'] / peak_of(k, p):6.0%} of peak" if k["peak"] else "  (its own ISA, not this build's)")
        if k.get("format_bound"):  # the products' share the format's own scaling leaves (probe_int8_format)
            beside += (f"  (the format's arithmetic alone, its scales included: {k['format_bound'] / peak_of(k, p):.0%} "
                       f"of peak; the kernel at {k['rate'] / k['format_bound']:.0%} of it)")
        lines.append(f"  {k['kernel']:<23} {k['format']:<6} {k['shape']:>15} {k['seconds'] * 1e3:8.2f} ms "
                     f"{k['rate']:9,.1f} {k['unit']:<8} {share}{beside}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="deltaserve bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads (default: torch's)")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--stream-mb", type=int, default=None,
                   help="MB each decode row and the read peak stream (default: 4x the L3 the OS reports, at least "
                        "128; less runs faster, but matrices the caches hold read faster than memory)")
    args = p.parse_args(argv)
    if args.stream_mb is not None and args.stream_mb < 1:
        p.error(f"--stream-mb must be at least 1, not {args.stream_mb}")
    if not fused.available():
        raise SystemExit("deltaserve bench kernels: the C++ kernels did not build here")
    r = report(args.threads, args.stream_mb)
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
