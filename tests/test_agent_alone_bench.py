"""bench/overhead.py --agent-alone runs (issue 25, goal 1): off, beside and on in the bench's process and the
training without the checker in a child process the agent never ran in ("apart", the goal's reference: the agent
fixes glibc's malloc thresholds of its own process, npu_agent/freed_memory.py), each with its page faults, and the
ratios against both. Timings are never asserted: two steps a variant leave them to chance."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "overhead.py")


def test_the_agent_alone_bench_measures_the_training_apart_too(tmp_path):
    where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    # TinyLM, two steps a variant: the bench's own workings, not its figures (the mid transformer takes a minute)
    run = subprocess.run([sys.executable, BENCH, "--agent-alone", "--agent-alone-model", "tiny", "--mid-steps", "2",
                          "--rounds", "1", "--folder", where], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = run.stdout
    m = re.search(r"agent: (\d+) captured, (\d+) written, 0 dropped", out)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) > 0, out
    for variant in ("apart", "off", "beside", "on"):
        assert re.search(rf"^  {variant}\s+wall\s+\d+\.\d\d ms/step .* page faults\s+\d+/step$", out, re.M), \
            (variant, out)
    assert "ratios (on / apart)" in out, out
    assert re.search(r"^  on / off in this process: wall \d+\.\d\d, training-thread CPU \d+\.\d\d; off / apart",
                     out, re.M), out
    left = subprocess.run(["pgrep", "-f", "--", "--off-apart"], capture_output=True, text=True).stdout.split()
    assert not left, f"the off-apart child outlived the bench: {left}"
