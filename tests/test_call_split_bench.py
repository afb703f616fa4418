"""bench/call_split.py (issue 25, goal 2): a captured call's cost split by piece, each variant leaving one piece out
for its steps. Timings are never asserted; what is: every variant is measured and printed, the capture with every
piece captures every call of the step, and every function a variant replaced is back after its steps, also when a
step raised. The bench pins its process to one core on import, so it runs in a process of its own here."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "call_split.py")
VARIANTS = ("every piece", "no backward taps", "no hooks (the taps kept)", "no backward record",
            "no random state nor mask", "no module path", "no source line", "no autocast state")


def test_the_split_prints_every_variant_and_the_loop(tmp_path):
    run = subprocess.run([sys.executable, BENCH, "--steps", "1", "--rounds", "2", "--loop-calls", "12",
                          "--touch-kib", "64"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = run.stdout
    assert re.search(r"^TinyLM .*: 55 captured calls a step \(108 records with the backward ones\)", out, re.M), out
    for name in VARIANTS:
        assert re.search(rf"^  {re.escape(name)}\s+\d+\.\d{{3}}\s+-?\d+\.\d", out, re.M), (name, out)
    assert "a loop of 13 plain calls (no module, no random call, no optimizer, 64 KiB written between calls)" in out
    assert re.search(r"^  TinyLM, every piece\s+-?\d+\.\d\s+goal <= 20$", out, re.M), out
    assert re.search(r"^  a loop of plain calls\s+-?\d+\.\d\s+goal <= 20$", out, re.M), out


CHECK = """
import call_split
assert set(call_split.LEFT_OUT) | {call_split.NO_TAPS, "every piece"} == set(VARIANTS), sorted(call_split.LEFT_OUT)
for name, patches in call_split.LEFT_OUT.items():
    before = [getattr(obj, attr) for obj, attr, _ in patches]
    try:
        with call_split.left_out(patches):
            assert all(getattr(obj, attr) is value for obj, attr, value in patches), name
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert [getattr(obj, attr) for obj, attr, _ in patches] == before, name
print("put back")
"""


def test_a_variant_puts_back_what_it_left_out(tmp_path):
    script = f"import sys\nsys.path.insert(0, {os.path.dirname(BENCH)!r})\nVARIANTS = {VARIANTS!r}\n{CHECK}"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "put back", run.stdout[-2000:] + run.stderr[-4000:]
