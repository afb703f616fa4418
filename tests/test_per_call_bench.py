"""bench/overhead.py --per-call --baseline runs (issue 25, goal 2): the two checkouts are measured by two processes
that stay up, the rounds alternating, and both are printed with every ratio before -> after. Timings are never
asserted, nor the sign of a difference, which a one-step run leaves to chance. The baseline here is this checkout
reached through a symbolic link, so that the line naming what each process measured (the folder its npu_agent was
imported from) tells the two processes apart."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "overhead.py")
RATIOS = ("no-op mode us/call", "skipped us/call", "skipped / no-op", "loop no-op us/call", "loop skipped us/call",
          "loop skipped / no-op", "captured us/captured call", "captured us/record")


def test_the_per_call_bench_alternates_two_checkouts_and_prints_both(tmp_path):
    base = tmp_path / "base"
    base.symlink_to(ROOT, target_is_directory=True)
    run = subprocess.run([sys.executable, BENCH, "--per-call", "--per-call-steps", "1", "--per-call-rounds", "2",
                          "--baseline", str(base)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = run.stdout
    assert f"ms/step [before: {base}]" in out and f"ms/step [after: {ROOT}]" in out, out
    assert "2 steps a variant" in out, out   # 2 rounds of 1 step in each process
    for name in RATIOS:
        # before -> after; not their values: with a step a round, the no-op mode's fastest step may beat off's
        assert re.search(rf"^  {re.escape(name)}\s+-?\d+\.\d\d ->\s+-?\d+\.\d\d", out, re.M), (name, out)
