"""gpu_server/reports/cpu_use.py: the server's CPU by thread role (summary.json `cpu_s`). Real threads spinning for a
known CPU time: each counted under its role (its name without a trailing number), from the count's start on; a
thread that ended keeps its last reading; the threads' sum within the process's own CPU. A real server's summary is
checked in tests/test_e2e.py."""
from __future__ import annotations

import threading
import time

import pytest

from gpu_server.reports import cpu_use
from gpu_server.reports.cpu_use import CpuUse, role


def _spin(seconds: float, started: threading.Event | None = None, go: threading.Event | None = None) -> None:
    if started is not None:
        started.set()
    if go is not None:
        go.wait()
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_roles_are_names_without_their_number():
    assert role("gpu-server-worker-0") == role("gpu-server-worker-12") == "gpu-server-worker"
    assert role("gpu-server-intake_3") == "gpu-server-intake"
    assert role("gpu-server-folder") == "gpu-server-folder"
    assert role("MainThread") == "MainThread"


@pytest.mark.skipif(not cpu_use.os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_each_role_counts_its_threads_cpu_from_the_start_on():
    started, go = threading.Event(), threading.Event()
    before = threading.Thread(target=_spin, args=(0.3, started, go), name="bench-old-0")
    before.start()
    started.wait()
    _spin(0.2)   # this thread's CPU before the count: not counted
    use = CpuUse(every_s=0.05).start()
    go.set()
    workers = [threading.Thread(target=_spin, args=(s,), name=f"bench-worker-{i}") for i, s in enumerate((0.3, 0.2))]
    for t in workers:
        t.start()
    for t in [*workers, before]:
        t.join()
    time.sleep(0.2)   # readings after they ended: their last ones stay
    use.stop()
    cpu = use.as_dict()
    threads = cpu["threads"]
    assert 0.35 <= threads["bench-worker"] <= 0.6, cpu   # 0.5 s spun, less what the last reading missed
    assert 0.15 <= threads["bench-old"] <= 0.4, cpu      # 0.3 s spun after the count began
    assert threads.get("MainThread", 0.0) < 0.15, cpu    # its 0.2 s spin came before the count
    assert sum(threads.values()) <= cpu["process"] + 0.01 and cpu["rest"] >= 0, cpu
    assert list(threads) == sorted(threads, key=lambda k: -threads[k]), "busiest first"
    assert "gpu-server-cpu-use" in threads   # the reading thread itself, counted too
    assert not any(t.name == "gpu-server-cpu-use" for t in threading.enumerate()), "stop() ends the reading thread"


def test_without_proc_the_threads_are_not_split(monkeypatch):
    monkeypatch.setattr(cpu_use, "_TASKS", "/nonexistent/task")
    use = CpuUse().start()
    use.stop()
    cpu = use.as_dict()
    assert cpu["threads"] == {} and cpu["rest"] == cpu["process"] > 0, cpu
