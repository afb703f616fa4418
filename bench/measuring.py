"""The measuring processes of a benchmark's `--baseline` run (bench/intake.py, bench/overhead.py --per-call,
bench/sampling.py): each checkout measured by a process of its own that stays up, the rounds alternating between
them. The test VM's speed drifts by 10-30 % within minutes, which runs one after the other would read as a change.
And the CPU a process (`process_stat`) and each thread (`thread_cpu`) spent so far: which of the agent's threads
spends what (bench/sampling.py, transport.py), what a server's processes spend (bench/server_start.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence


class MeasuringProcess:
    """`script` (this checkout's benchmark) run with `argv` (its serve mode), importing the code of the checkout at
    `repo` (first on its PYTHONPATH, the working folder); it says READY once set up and answers each request line
    with one line. `cores`: the CPUs it starts on (a benchmark that pins itself at import passes the ones it had
    before; None: this process's)."""

    def __init__(self, script: str, repo: str, argv: list[str], cores: Iterable[int] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
        self.repo = repo
        start = set(cores) if cores is not None else None
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), *argv], cwd=repo, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=None if start is None else lambda: os.sched_setaffinity(0, start))

    def ready(self) -> None:
        self._expect("READY")

    def ask(self, request: str, answer: str) -> str:
        """Send `request`; its answer line, which must start with `answer`."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self._expect(answer)

    def _expect(self, what: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(what):
            raise RuntimeError(f"the measuring process for {self.repo} answered {line!r}, not {what!r}...")
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def in_turn(labels: Sequence[str], r: int) -> Sequence[str]:
    """The order of round `r`: `labels` as given, reversed every other round."""
    return labels if r % 2 == 0 else labels[::-1]


def process_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system, in clock ticks) of a live process from /proc/PID/stat; None once it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ThreadCpu = dict[int, tuple[str, float]]   # thread id -> (its name, CPU seconds)


def thread_cpu() -> ThreadCpu:
    """CPU seconds of each thread of this process so far: {thread id: (name, seconds)}, from the scheduler's own
    count (/proc/self/task/TID/schedstat, nanoseconds: exact, where utime and stime are counted in clock ticks). The
    name is the Python thread's where the thread is one, else the kernel's (a C library's thread: gRPC's C core).
    Empty where /proc is not there."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: ThreadCpu = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                ns = int(fh.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as fh:
                    name = "[C] " + fh.read().strip()
        except (OSError, ValueError, IndexError):   # the thread ended meanwhile
            continue
        out[int(tid)] = (name, ns / 1e9)
    return out


def cpu_since(before: ThreadCpu, after: ThreadCpu) -> ThreadCpu:
    """Each thread's CPU between two `thread_cpu()` readings (a thread started meanwhile: all of its CPU)."""
    return {tid: (name, s - before.get(tid, (name, 0.0))[1]) for tid, (name, s) in after.items()}


AGENT_THREADS = ("the sender", "the stream's reader", "gRPC's Python threads", "gRPC's C core")


def agent_thread(name: str) -> str | None:
    """Which of the agent's threads a thread named `name` (by `thread_cpu`) is, as AGENT_THREADS names them; None
    for the main thread (the training's, or a benchmark's own). The sender encodes records and hands them to the
    transport; the stream's reader (npu_agent/transport_grpc.py) reads the server's answers; gRPC's Python threads
    hand the requests to gRPC and deliver its answers; its C core moves the bytes."""
    if name == "MainThread":
        return None
    if name == "online-check-sender":
        return AGENT_THREADS[0]
    if name.startswith("online-check"):
        return AGENT_THREADS[1]
    return AGENT_THREADS[3] if name.startswith("[C] ") else AGENT_THREADS[2]


def agent_threads_since(before: ThreadCpu) -> dict[str, float]:
    """The CPU seconds of each of the agent's threads (AGENT_THREADS) since the `thread_cpu()` reading `before`."""
    out = dict.fromkeys(AGENT_THREADS, 0.0)
    for name, seconds in cpu_since(before, thread_cpu()).values():
        role = agent_thread(name)
        if role is not None:
            out[role] += seconds
    return out


def agent_threads_line(seconds: dict[str, float], records: int) -> str:
    """`seconds` (agent_threads_since) as CPU a record, each thread named."""
    return ", ".join(f"{role} {seconds.get(role, 0.0) / records * 1e6:.0f} us" for role in AGENT_THREADS)
