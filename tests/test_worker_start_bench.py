"""bench/worker_start.py runs (issue 25): a replacement replay worker's start, forked and fresh, each timed and
replaying the record as the first worker did, printed with the ratio (timings are never asserted)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "worker_start.py")


def test_the_worker_start_bench_times_both_ways_and_prints_the_ratio(tmp_path):
    run = subprocess.run([sys.executable, BENCH, "--rounds", "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    for way in ("forked", "fresh"):
        [line] = [x for x in lines if x.startswith(way + " ") and "fastest" in x]
        assert float(line.rsplit("fastest ", 1)[1].split()[0]) > 0, line
    assert float(lines[-1].split(": ")[1].rstrip("x")) > 0, lines[-1]
