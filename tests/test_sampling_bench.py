"""bench/sampling.py --baseline runs (issue 25, goal 3): the two checkouts are measured by two processes that stay
up, each with its own gpu-server and agents, the rounds alternating, and both are printed before/after with each
policy's ratios. Timings are never asserted. The baseline here is this checkout reached through a symbolic link,
so that the line naming what each process measured (the folder its npu_agent was imported from) tells them apart."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "sampling.py")


def test_the_sampling_bench_alternates_two_checkouts_and_prints_both(tmp_path):
    base = tmp_path / "base"
    base.symlink_to(ROOT, target_is_directory=True)
    run = subprocess.run([sys.executable, BENCH, "--policies", "coverage K=4", "--steps", "2", "--rounds", "2",
                          "--layers", "2", "--baseline", str(base)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = run.stdout
    assert f"[before: {base}]" in out and f"[after: {ROOT}]" in out, out
    assert "4 steps a policy" in out, out   # 2 rounds of 2 steps in each process
    lines = out.splitlines()
    before = [i for i, line in enumerate(lines) if line.strip().startswith("coverage K=4    before: CPU x")]
    assert len(before) == 1 and lines[before[0] + 1].strip().startswith("after:  CPU x"), out
    records = [line for line in lines if line.strip().startswith("coverage K=4    CPU") and "records" in line]
    assert len(records) == 2 and all("(acknowledged" in line for line in records), out
