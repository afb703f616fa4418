"""Starting replay worker processes, ahead of time when the server knows it will need them (docs/design.md §6.8).

A replay worker (gpu_server/replay/sandbox_worker.py) spends about 2 s of CPU before it can replay: importing torch
and loading the meta kernels. `gpu-server` itself spends about 1 s importing torch, on one core, and only then built
its workers, so on a 2-core host a core stood idle for a second and the workers were ready a second later. Now every
worker interpreter is started by `launch` and told what to be (its folder, device, threads, memory cap) by a first
message on its pipe (`ProcessReplayer` sends it), so it can be started before it is known: `gpu-server` starts
`--workers` of them (`start`) before it imports torch, they import while it does, and each `ProcessReplayer` takes
one (`take`), or launches one then. `discard` kills those nobody took (they hold nothing yet), when the server is
built and at exit; one left behind anyway exits once its pipe closes.

Where the server can adopt its descendants (Linux), it starts one fork server instead
(gpu_server/replay/fork_server.py): it imports torch and forks a process that loads the meta kernels once, while the
server goes on with its start, and then forks each worker `take` asks for, the first ones and every replacement, in
milliseconds instead of 2.7 s of CPU each. A process that is not `gpu-server` at its start (a test, a benchmark, one
running threads) gets a fork server that is an interpreter of its own, which imports torch itself. Elsewhere, with
GPU_SERVER_FORK_SERVER=0, or once the fork server is gone, `take` hands out the interpreters started ahead and
`launch` starts a fresh one.

This module imports torch only to fork the fork server (`start` in gpu-server's main).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
import threading

from gpu_server import malloc_policy, omp_wait
from gpu_server.replay import fork_server
from gpu_server.replay.fork_server import ForkedWorker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Launched:
    """A replay worker interpreter, waiting for its arguments: its process, and the pipe ends to it and from it."""

    proc: subprocess.Popen | ForkedWorker
    to_child: int
    from_child: int
    how: str = ""   # "started ahead", "forked" (by the fork server), "" (started when it was needed)

    def close(self) -> None:
        for fd in (self.to_child, self.from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self.to_child = self.from_child = -1


_lock = threading.Lock()
_waiting: list[Launched] = []
_forks: fork_server.Client | None = None
FORK_SERVER_ENV = "GPU_SERVER_FORK_SERVER"   # "0": every worker a fresh interpreter, as where fork_server cannot run
START_TIMEOUT_S = 180.0   # a worker interpreter imports torch: slow on a loaded host, never a reason to give up early


def _environment() -> dict[str, str]:
    """The environment of every worker, and of the fork server."""
    env = dict(os.environ, MALLOC_ARENA_MAX=str(malloc_policy.WORKER_ARENAS), PYTHONUNBUFFERED="1")
    omp_wait.passive(env)
    return env


def _popen(module: str, args: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
    """A worker interpreter (or the fork server) running `module`, with the environment every worker gets."""
    # a session of its own: a signal to the server's process group (Ctrl-C in a terminal, `timeout`, `kill --
    # -PGID`) reaches the server, which drains, and not the replay it waits for (sandbox_worker.main)
    return subprocess.Popen([sys.executable, "-m", module, *args], pass_fds=fds, stdin=subprocess.DEVNULL,
                            env=_environment(), cwd=ROOT, start_new_session=True)


def launch() -> Launched:
    """Start one replay worker interpreter (it imports torch, then waits for its arguments on its pipe)."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    try:
        proc = _popen("gpu_server.replay.sandbox_worker", ["--rfd", str(to_child_r), "--wfd", str(from_child_w)],
                      (to_child_r, from_child_w))
    except BaseException:
        os.close(to_child_w)
        os.close(from_child_r)
        raise
    finally:
        os.close(to_child_r)
        os.close(from_child_w)
    return Launched(proc, to_child_w, from_child_r)


def start(n: int, fork: bool = False) -> None:
    """Get ready to hand out n workers: start the fork server, or else launch n worker interpreters now, for the
    `ProcessReplayer`s to come (best effort: a worker that cannot be had now is launched when it is needed, and says
    why then). `fork`: the fork server may be a fork of this process, which has run no torch operation and started
    no thread (gpu-server's main, at its start); it is a fresh interpreter otherwise, or where a thread runs."""
    global _forks
    if n <= 0:
        return
    atexit.register(stop)
    if _forks is None and os.environ.get(FORK_SERVER_ENV, "") != "0" and fork_server.become_subreaper():
        # (a subreaper before the fork server exists: it inherits the mark, and its forks find the server)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if fork and threading.active_count() == 1:
                # torch once, in this process, before the fork: the fork server then loads only the meta kernels
                # (1.3 s of CPU while this process goes on with its start) instead of importing torch a second time
                import torch  # noqa: F401

                proc: subprocess.Popen | fork_server.Child = fork_server.fork_here(theirs, ours, _environment(), ROOT)
            else:   # a process that runs threads (or torch operations, for all we know): a fresh interpreter
                proc = _popen("gpu_server.replay.fork_server", ["--sock", str(theirs.fileno())], (theirs.fileno(),))
        except OSError:
            ours.close()
        else:
            _forks = fork_server.Client(proc, ours)
            return
        finally:
            theirs.close()
    for _ in range(n):
        try:
            one = launch()
        except OSError:
            return
        one.how = "started ahead"
        with _lock:
            _waiting.append(one)


def _forked() -> Launched | None:
    """A worker the fork server forks now (it reads its arguments from its pipe once forked), or None when there is
    no fork server any more."""
    client = _forks
    if client is None or not client.alive():
        return None
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    try:
        number = client.fork(to_child_r, from_child_w)
    except OSError:
        os.close(to_child_w)
        os.close(from_child_r)
        return None
    finally:
        os.close(to_child_r)
        os.close(from_child_w)
    return Launched(ForkedWorker(client, number, START_TIMEOUT_S), to_child_w, from_child_r, "forked")


def take() -> Launched | None:
    """A worker forked by the fork server, else a pre-started worker interpreter still running, else None."""
    forked = _forked()
    if forked is not None:
        return forked
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


def stop() -> None:
    """At exit: `discard`, and end the fork server (the workers it forked are the server's, and end with it)."""
    global _forks
    discard()
    client, _forks = _forks, None
    if client is not None:
        client.close()
        fork_server.become_subreaper(False)   # the workers forked so far stay this process's children
