"""bench/server_start.py runs (issue 25): `gpu-server` started from two checkouts in turn (here this one twice), each
start timed to its listening and to its processes settling, with the CPU of the server and of its children (the fork
server and the first replay worker), and the floor; timings are never asserted."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "server_start.py")
START = re.compile(r"^(this|baseline) +listening +([\d.]+) s, settled +([\d.]+) s, CPU: server +([\d.]+) s, its "
                   r"children +([\d.]+) s, together +([\d.]+) s; memory \(PSS\) +(\d+) MiB$")


def test_the_server_start_bench_starts_both_checkouts_and_prints_them_against_the_floor(tmp_path):
    run = subprocess.run([sys.executable, BENCH, "--rounds", "1", "--baseline", ROOT], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("floor ") and float(lines[0].split("CPU ")[1].split()[0]) > 0, lines[0]
    starts = [START.match(x) for x in lines[1:3]]
    assert all(starts), lines
    assert {m.group(1) for m in starts} == {"this", "baseline"}
    for m in starts:
        listening, settled, server, children, together, memory = map(float, m.groups()[1:])
        assert 0 < listening <= settled, m.group(0)
        assert server > 0 and children > 0, m.group(0)   # the fork server (and the worker it forked) worked too
        assert abs(server + children - together) < 0.02, m.group(0)
        assert memory > 0, m.group(0)
    for label in ("this", "baseline"):
        [line] = [x for x in lines if x.startswith(label + " ") and "fastest" in x]
        assert float(line.split(" = ")[1].split("x")[0]) > 0, line
