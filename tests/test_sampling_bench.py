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
    # where the agent's threads spent their CPU (bench/measuring.thread_cpu): one line under each policy's, the
    # four threads named with a figure each, from both checkouts' processes
    threads = [line for line in lines if "the agent's threads, CPU a record:" in line]
    assert len(threads) == 2, out
    for line in threads:
        figures = dict(part.rsplit(" ", 2)[:2] for part in line.split(": ", 1)[1].split(", "))
        assert list(figures) == ["the sender", "the stream's reader", "gRPC's Python threads", "gRPC's C core"], line
        assert all(float(v) >= 0 for v in figures.values()) and float(figures["the sender"]) > 0, line


def test_thread_cpu_counts_each_threads_own_cpu_by_its_name():
    """bench/measuring.thread_cpu, which the line above is made of: a thread that spins for 0.3 s of CPU is counted
    about that under its Python name, and one that waits meanwhile next to nothing (read while both still run: an
    ended thread leaves /proc)."""
    import threading
    import time

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from measuring import cpu_since, thread_cpu

    spun, release = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait(30)

    before = thread_cpu()
    threads = [threading.Thread(target=spin, name="bench-spinner"),
               threading.Thread(target=release.wait, args=(30,), name="bench-waiter")]
    for t in threads:
        t.start()
    try:
        assert spun.wait(30)
        by_name = {name: seconds for name, seconds in cpu_since(before, thread_cpu()).values()}
    finally:
        release.set()
        for t in threads:
            t.join()
    assert 0.25 <= by_name["bench-spinner"] < 5, by_name
    assert by_name["bench-waiter"] < 0.05, by_name
