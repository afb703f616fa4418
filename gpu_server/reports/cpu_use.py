"""Where the server's CPU went, for the summary (summary.json `cpu_s`; bench/server.py prints it under each run): its
own process, its replay workers, and its Python threads by role. On a bench without `perf` (a lent GPU host, a
container), that says which part of the server sets its pace.

- `process`: the server process's CPU, user and system, over its whole life (its start included), from the kernel
  (`resource.getrusage`);
- `replay_workers`: the CPU of the child processes it has waited for: the replay workers, each counted once it has
  stopped (the server stops and waits for every one before the summary; gpu_server/replay/sandbox.py). The fork
  server's own start (gpu_server/replay/fork_server.py) is not in it: it ends after the summary is written;
- `threads`: the CPU of each of the server's Python threads since the count began (`CpuUse.start`, as the server is
  set up), by role: a thread's name without a trailing number, so that the checking threads `gpu-server-worker-0`,
  `-1`, ... are one role, and `gpu-server-intake_0`, `_1`, ... another. Each thread's CPU, as the scheduler counts
  it (/proc/self/task/TID/schedstat, nanoseconds; a thread that has ended is simply not there), is read once a second
  and its last reading kept, so a thread that ends keeps what it had a second before (the server's threads end when
  it stops, idle by then);
- `rest`: `process` less `threads`: the start before the count began, the threads that are not Python's (torch's
  OpenMP threads, gRPC's core), and the last second of threads that ended.

Where /proc is not there (not Linux), `threads` is empty and `rest` is all of `process`.
"""
from __future__ import annotations

import os
import re
import resource
import threading
from typing import Any

EVERY_S = 1.0                                # how often the threads' clocks are read
_NUMBERED = re.compile(r"[-_]\d+$")          # "gpu-server-worker-0", "gpu-server-intake_3": the role's number
_TASKS = "/proc/self/task"


def role(name: str) -> str:
    """A thread's role: its name without a trailing number."""
    return _NUMBERED.sub("", name)


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


class CpuUse:
    """The server's CPU by process and by thread role (module docstring). `start()` begins reading the threads'
    clocks; `stop()` reads them a last time and ends the reading thread; `as_dict()` is the summary's `cpu_s`."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self._every = every_s
        self._lock = threading.Lock()
        # the threads alive at the last reading: (thread ident, native id) -> [name, CPU seconds at its first reading,
        # at its last]; those that ended since: CPU seconds by role (so a long run keeps one entry a live thread)
        self._seen: dict[tuple[int, int | None], list[Any]] = {}
        self._ended: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CpuUse:
        """Count from now: a thread running already counts what it spends from here on, one started later all of
        its CPU."""
        self.read(first=True)
        if os.path.isdir(_TASKS):
            self._thread = threading.Thread(target=self._run, name="gpu-server-cpu-use", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.read()

    def read(self, first: bool = False) -> None:
        """Read every live Python thread's CPU (`first`: the readings the count starts from)."""
        live = threading.enumerate()
        alive = {(t.ident, t.native_id) for t in live}
        with self._lock:
            for key in [k for k in self._seen if k not in alive]:   # ended: its last reading stays, by role
                name, start, last = self._seen.pop(key)
                self._ended[role(name)] = self._ended.get(role(name), 0.0) + max(0.0, last - start)
        for t in live:
            if t.ident is None or t.native_id is None:
                continue
            try:
                with open(f"{_TASKS}/{t.native_id}/schedstat", "rb") as fh:
                    seconds = int(fh.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):   # it ended meanwhile, or no /proc
                continue
            key = (t.ident, t.native_id)
            with self._lock:
                entry = self._seen.get(key)
                if entry is None:   # a thread started since the last reading: all of its CPU counts
                    self._seen[key] = [t.name, seconds if first else 0.0, seconds]
                else:
                    entry[0], entry[2] = t.name, seconds

    def stop(self) -> None:
        """A last reading; the reading thread ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.read()

    def as_dict(self) -> dict[str, Any]:
        """summary.json `cpu_s` (seconds, rounded to milliseconds; the roles busiest first)."""
        with self._lock:
            by_role = dict(self._ended)
            for name, first, last in self._seen.values():
                by_role[role(name)] = by_role.get(role(name), 0.0) + max(0.0, last - first)
        process = _cpu(resource.getrusage(resource.RUSAGE_SELF))
        threads = sum(by_role.values())
        return {"process": round(process, 3),
                "replay_workers": round(_cpu(resource.getrusage(resource.RUSAGE_CHILDREN)), 3),
                "threads": {k: round(v, 3) for k, v in sorted(by_role.items(), key=lambda kv: (-kv[1], kv[0]))},
                "rest": round(max(0.0, process - threads), 3)}
