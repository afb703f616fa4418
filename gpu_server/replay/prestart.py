"""Starting replay worker processes, ahead of time when the server knows it will need them (docs/design.md §6.8).

A replay worker (gpu_server/replay/sandbox_worker.py) spends about 2 s of CPU before it can replay: importing torch
and loading the meta kernels. `gpu-server` itself spends about 1 s importing torch, on one core, and only then built
its workers, so on a 2-core host a core stood idle for a second and the workers were ready a second later. Now every
worker interpreter is started by `launch` and told what to be (its folder, device, threads, memory cap) by a first
message on its pipe (`ProcessReplayer` sends it), so it can be started before it is known: `gpu-server` starts
`--workers` of them (`start`) before it imports torch, they import while it does, and each `ProcessReplayer` takes
one (`take`), or launches one then. `discard` kills those nobody took (they hold nothing yet), when the server is
built and at exit; one left behind anyway exits once its pipe closes.

This module does not import torch: the command line imports it first.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import subprocess
import sys
import threading

from gpu_server import omp_wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Launched:
    """A replay worker interpreter, waiting for its arguments: its process, and the pipe ends to it and from it."""

    proc: subprocess.Popen
    to_child: int
    from_child: int

    def close(self) -> None:
        for fd in (self.to_child, self.from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self.to_child = self.from_child = -1


_lock = threading.Lock()
_waiting: list[Launched] = []


def launch() -> Launched:
    """Start one replay worker interpreter (it imports torch, then waits for its arguments on its pipe)."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    env = omp_wait.passive(dict(os.environ, MALLOC_ARENA_MAX="2", PYTHONUNBUFFERED="1"))
    cmd = [sys.executable, "-m", "gpu_server.replay.sandbox_worker", "--rfd", str(to_child_r),
           "--wfd", str(from_child_w)]
    try:
        # a session of its own: a signal to the server's process group (Ctrl-C in a terminal, `timeout`, `kill --
        # -PGID`) reaches the server, which drains, and not the replay it waits for (sandbox_worker.main)
        proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                start_new_session=True)
    except BaseException:
        os.close(to_child_w)
        os.close(from_child_r)
        raise
    finally:
        os.close(to_child_r)
        os.close(from_child_w)
    return Launched(proc, to_child_w, from_child_r)


def start(n: int) -> None:
    """Launch n worker interpreters now, for the `ProcessReplayer`s to come (best effort: one that cannot be
    started now is launched when it is needed, and says why then)."""
    if n > 0:
        atexit.register(discard)
    for _ in range(n):
        try:
            one = launch()
        except OSError:
            return
        with _lock:
            _waiting.append(one)


def take() -> Launched | None:
    """A pre-started worker interpreter still running, or None."""
    while True:
        with _lock:
            if not _waiting:
                return None
            one = _waiting.pop(0)
        if one.proc.poll() is None:
            return one
        one.close()   # ended before it was needed (killed from outside): the caller launches another


def discard() -> None:
    """End the pre-started interpreters nobody took (the server uses fewer, replays in its own threads, or stopped at
    a bad option): they hold nothing yet, so they are killed. Also run at exit."""
    with _lock:
        left = _waiting[:]
        _waiting.clear()
    for one in left:
        one.close()
        if one.proc.poll() is None:
            one.proc.kill()
        one.proc.wait()
