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


def _spin(seconds: float, spun: threading.Event | None = None, done: threading.Event | None = None,
          go: threading.Event | None = None) -> None:
    """Spend `seconds` of this thread's CPU (after `go`), say so (`spun`), and end once told (`done`)."""
    if go is not None:
        go.wait()
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    if spun is not None:
        spun.set()
    if done is not None:
        done.wait()


def test_roles_are_names_without_their_number():
    assert role("gpu-server-worker-0") == role("gpu-server-worker-12") == "gpu-server-worker"
    assert role("gpu-server-intake_3") == "gpu-server-intake"
    assert role("gpu-server-folder") == "gpu-server-folder"
    assert role("MainThread") == "MainThread"


@pytest.mark.skipif(not cpu_use.os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_each_role_counts_its_threads_cpu_from_the_start_on():
    """Readings taken by hand (the reading thread's period set far off), so that each thread is read after it spun
    and before it ends: what a thread spends after its last reading is not counted (the server's threads end idle)."""
    go, old_spun, done = threading.Event(), threading.Event(), threading.Event()
    before = threading.Thread(target=_spin, args=(0.3, old_spun, done, go), name="bench-old-0")
    before.start()
    _spin(0.2)   # this thread's CPU before the count: not counted
    use = CpuUse(every_s=3600).start()
    go.set()
    spun = [threading.Event(), threading.Event()]
    workers = [threading.Thread(target=_spin, args=(s, e, done), name=f"bench-worker-{i}")
               for i, (s, e) in enumerate(zip((0.3, 0.2), spun))]
    for t in workers:
        t.start()
    for e in (*spun, old_spun):
        assert e.wait(60)
    use.read()   # each has spun: read before they end
    done.set()
    for t in [*workers, before]:
        t.join()
    use.read()   # they ended: kept by their role
    live = {(t.ident, t.native_id) for t in threading.enumerate()}
    assert set(use._seen) <= live, "an ended thread is kept by its role only: one entry a live thread"
    use.stop()
    cpu = use.as_dict()
    threads = cpu["threads"]
    assert 0.5 <= threads["bench-worker"] <= 0.6, cpu   # 0.3 + 0.2 s spun
    assert 0.3 <= threads["bench-old"] <= 0.4, cpu      # all of its spin came after the count began
    assert threads.get("MainThread", 0.0) < 0.15, cpu   # its 0.2 s spin came before the count
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
