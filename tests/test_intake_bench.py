"""bench/intake.py runs (issue 25): each kind of record, before and after, is printed with its ratio to the floor
(timings are never asserted), and a record the intake does not take as a job fails the bench instead of being timed
as a quick refusal."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "intake.py")
KINDS = ("relu 4 KiB", "relu", "linear", "layer_norm")


def test_the_intake_bench_prints_every_kind_before_and_after(tmp_path):
    run = subprocess.run([sys.executable, BENCH, "--records", "40", "--rounds", "2", "--baseline", ROOT],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    for kind in KINDS:
        for tree in ("before", "after"):
            rows = [line.split() for line in lines if line[:12].strip() == kind and line[13:20].strip() == tree]
            assert len(rows) == 1, (kind, tree, run.stdout)
            intake, floor, ratio = (float(x) for x in rows[0][-3:])
            assert intake > 0 and floor > 0 and abs(ratio - intake / floor) < 0.01 + 0.01 * ratio, rows[0]
        ratios = lines[lines.index("ratios: after/before, intake time a record") + 1:]
        assert sum(line[:14].strip() == kind and float(line.split()[-1]) > 0 for line in ratios) == 1, run.stdout


def test_a_record_the_intake_refuses_fails_the_bench(tmp_path):
    """A server that refuses every record (here: its allowlist without relu, linear and layer_norm, patched in by a
    sitecustomize on the measuring process's path) must not be timed as if its intake were fast."""
    (tmp_path / "sitecustomize.py").write_text(
        "import protos.apis as a\n"
        "a.ALLOWLIST['Functional'] = frozenset(n for n in a.ALLOWLIST['Functional']\n"
        "                                      if n not in ('relu', 'linear', 'layer_norm'))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, BENCH, "--records", "20", "--rounds", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode != 0, run.stdout
    assert "the intake took 0 of 20 records: 20 rejected" in run.stderr, run.stderr[-3000:]
