#!/usr/bin/env python3
"""What a replay worker costs to start: forked by the fork server against started as a fresh interpreter, side by
side in one run (docs/performance.md, "Forked replay workers").

    python bench/worker_start.py [--rounds 3]

For each way (`forked`: gpu_server/replay/fork_server.py, as gpu-server starts its workers on Linux; `fresh`: with
GPU_SERVER_FORK_SERVER=0, every worker a new interpreter), one `ProcessReplayer` replays a small relu record, then,
`--rounds` times, its worker is killed with SIGKILL and the same record is replayed again: the replacement worker
starts, gets its arguments and replays. Prints each replacement's seconds (start and one small replay), the fastest
of each way, and fresh / forked last. Each way runs in a process of its own (the fork server is started once per
process), forked first.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _one_way(way: str, rounds: int) -> list[float]:
    """In this process: the replacement times of one way."""
    if way == "fresh":
        os.environ["GPU_SERVER_FORK_SERVER"] = "0"
    import torch

    from gpu_server.replay import prestart
    from gpu_server.replay.sandbox import ProcessReplayer, SandboxLimits
    from tests.test_sandbox import job_of, relu

    prestart.start(1)
    job = job_of(relu(0))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=120), 1, 64 << 20)
    times = []
    try:
        want = proc.forward(job, keep=False, match=True).bench[0]
        for _ in range(rounds):
            os.kill(proc._proc.pid, signal.SIGKILL)
            proc._proc.wait()
            t0 = time.perf_counter()
            got = proc.forward(job, keep=False, match=True).bench[0]   # replaced first: a new worker, then the replay
            times.append(time.perf_counter() - t0)
            if not torch.equal(got, want):
                sys.exit(f"{way}: the replacement worker replayed the record differently")
        if proc.replaced != rounds:
            sys.exit(f"{way}: {proc.replaced} workers replaced, not {rounds}")
    finally:
        proc.close()
        prestart.stop()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="replacements timed per way (default 3)")
    p.add_argument("--way", choices=("forked", "fresh"), help=argparse.SUPPRESS)   # internal: one way, this process
    ns = p.parse_args()
    if ns.way:
        print("BENCH " + json.dumps(_one_way(ns.way, ns.rounds)))
        return 0
    best = {}
    for way in ("forked", "fresh"):
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--way", way, "--rounds", str(ns.rounds)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        if run.returncode:
            sys.exit(f"{way}: failed\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
        times = json.loads([line for line in run.stdout.splitlines() if line.startswith("BENCH ")][-1][6:])
        best[way] = min(times)
        print(f"{way:7s} replacement worker, start and one relu replay: "
              f"{' '.join(f'{t:.3f}' for t in times)} s (fastest {best[way]:.3f} s)")
    print(f"fresh / forked: {best['fresh'] / best['forked']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
