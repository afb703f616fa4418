#!/usr/bin/env python3
"""The server's checking throughput with 1 and 2 CPU workers, measured side by side in one run.

    python bench/server_workers.py [--steps 150] [--width 128] [--ranks 2]

For each worker count: a fresh gpu-server (`--workers N --exit-when-done`), then `--ranks` training processes
(RANK=0..; jobs are routed to workers by rank, so 2 workers need at least 2 ranks) each capturing `--steps` steps of
a small MLP forward (4 records a step). Records/s = records checked / (server exit - first training loop start):
the agents are acknowledged at spool speed, so the time is the server's checking. Prints both and the ratio.
Takes about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_server.reports import files as report_files  # noqa: E402
from tests.support import Server, agent_config, run_training  # noqa: E402

TRAIN = r'''
import json, sys, time, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
steps, width = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
dbg = PrecisionDebugger(config_path=sys.argv[1])
xs = [torch.randn(32, width) for _ in range(8)]
t0 = time.time()
with torch.no_grad():
    for s in range(steps):
        dbg.start()
        F.log_softmax(model(xs[s % 8]), dim=-1)
        dbg.stop()
        dbg.step()
counts = dbg.close()
print("BENCH " + json.dumps({"start": t0, "captured": counts["captured"], "acknowledged": counts["acknowledged"]}))
'''


def measure(workers: int, ranks: int, steps: int, width: int) -> dict:
    work = tempfile.mkdtemp(prefix=f"bench-workers{workers}-")
    server = Server(work, args=("--workers", str(workers), "--world-size", str(ranks), "--exit-when-done",
                                "--device", "cpu")).start()
    cfg = agent_config(os.path.join(work, "agent.json"), server.port)
    results: dict[int, dict] = {}

    def rank(r: int) -> None:
        proc = run_training(TRAIN, cfg, str(steps), str(width), env={"RANK": str(r), "WORLD_SIZE": str(ranks)})
        results[r] = json.loads([x for x in proc.stdout.splitlines() if x.startswith("BENCH ")][-1][6:])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.proc.wait(600)
    end = time.time()
    server.stop()
    with open(glob.glob(report_files.summary_path(glob.escape(server.out), "*"))[0], encoding="utf-8") as fh:
        summary = json.load(fh)
    checked = sum(summary["records_received"].values())
    start = min(r["start"] for r in results.values())
    return {"workers": workers, "records": checked, "seconds": end - start, "rate": checked / (end - start),
            "acknowledged": sum(r["acknowledged"] for r in results.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    ns = p.parse_args()
    rows = [measure(n, ns.ranks, ns.steps, ns.width) for n in (1, 2)]
    for r in rows:
        print(f"workers={r['workers']}: {r['records']} records checked in {r['seconds']:.2f} s = "
              f"{r['rate']:.0f} records/s (acknowledged {r['acknowledged']})")
    print(f"2 workers / 1 worker: {rows[1]['rate'] / rows[0]['rate']:.2f}x "
          f"({os.cpu_count()} CPUs; one worker per rank at most)")


if __name__ == "__main__":
    main()
