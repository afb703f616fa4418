"""bench/encode.py runs (issue 25): the small records' encodings and the strided tensors' copies, each printed with
its ratio to the floor (timings are never asserted)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "encode.py")


def _run(*args: str) -> list[str]:
    run = subprocess.run([sys.executable, BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout.splitlines()


def test_small_records_are_timed_four_ways_with_their_ratios():
    lines = _run("--records", "8", "--rounds", "1", "--sizes", "4k")
    [times] = [x for x in lines if x.strip().startswith("4k:")]
    for way in ("together", "together, Python walk", "alone, joined", "floor"):
        assert f"{way} " in times, times
    assert "together/floor" in lines[-1] and "compiled/Python" in lines[-1]


def test_each_strided_layout_is_copied_three_ways_with_its_ratios():
    lines = [x for x in _run("--strided", "--rounds", "1") if "KiB" in x]
    assert len(lines) == 7
    for line in lines:
        for part in ("compiled ", "Python ", "floor ", "compiled/floor", "Python/floor", "compiled/Python"):
            assert part in line, line
        assert float(line.rsplit("compiled/Python ", 1)[1]) > 0, line
