"""Metric throughput on one core, side by side in one run: the compiled pass, the torch ops, a memory-copy floor.

    python bench/metric_throughput.py [--mi 4] [--repeat 5]

For one output of `--mi` Mi elements (float32, then bfloat16) against a float64 bench, as the checker does for each
output of a call: the device's output and the same-dtype run's output analysed in one pass over the bench
(`gpu_server.judging.metrics.prefetch`, docs/design.md §6.5). Variants:

* compiled:   metric_kernel's one-pass loop (numba; the server's default on a CPU bench when it is installed);
* torch ops:  the same statistics with torch ops (no numba, or a GPU bench), bit for bit the same values;
* copy floor: copying the bench and both outputs once (what reading every input once costs at least).

Each time is the best of `--repeat` runs, in CPU seconds of this process (one torch thread, pinned to one core).
Prints ns per element and output, and last the ratios: compiled / copy floor, torch ops / compiled.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})

import torch  # noqa: E402

torch.set_num_threads(1)

from gpu_server.judging import metric_kernel, metrics  # noqa: E402


def _best(fn, repeat: int) -> float:
    fn()   # warm-up: buffers, the kernel's first compile
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def bench_dtype(dtype: torch.dtype, n: int, repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    b = torch.randn(n, dtype=torch.float64, generator=g)
    device = (b + 1e-3 * torch.randn(n, dtype=torch.float64, generator=g) * b).to(dtype)
    same = b.to(dtype)

    def analyse() -> None:
        with metrics.shared():
            metrics.prefetch(b, [device, same])

    def copy_floor() -> None:
        for t in (b, device, same):
            torch.empty_like(t).copy_(t)

    out = {}
    try:
        if metric_kernel.kernel() is not None:
            out["compiled"] = _best(analyse, repeat)
        metrics.USE_KERNEL = False
        out["torch ops"] = _best(analyse, repeat)
    finally:
        metrics.USE_KERNEL = True
    out["copy floor"] = _best(copy_floor, repeat)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mi", type=float, default=4, help="elements per output, in Mi (default 4)")
    p.add_argument("--repeat", type=int, default=5)
    ns = p.parse_args()
    n = int(ns.mi * (1 << 20))
    if metric_kernel.kernel() is None:
        print("numba is not installed: only the torch ops are measured (pip install -e '.[fast]')")
    results = {dt: bench_dtype(dt, n, ns.repeat) for dt in (torch.float32, torch.bfloat16)}
    print(f"metrics of two outputs (device, same-dtype run) of {n:,} elements each against a float64 bench, one core")
    for dt, r in results.items():
        for name, s in r.items():
            label = str(dt).replace("torch.", "")
            print(f"  {label:9s} {name:11s} {s * 1e3:8.1f} ms   {s / (2 * n) * 1e9:6.2f} ns per element and output")
    print("ratios")
    for dt, r in results.items():
        line = f"  {str(dt).replace('torch.', ''):9s}"
        if "compiled" in r:
            line += (f" compiled / copy floor {r['compiled'] / r['copy floor']:.1f}x, "
                     f"torch ops / compiled {r['torch ops'] / r['compiled']:.1f}x")
        else:
            line += f" torch ops / copy floor {r['torch ops'] / r['copy floor']:.1f}x"
        print(line)


if __name__ == "__main__":
    main()
