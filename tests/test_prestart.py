"""Replay workers made ahead (gpu_server/replay/prestart.py): gpu-server starts its fork server
(gpu_server/replay/fork_server.py) before it imports torch, and its workers, first ones and replacements, are forked
by it as the server's own children (none left over); without the fork server (GPU_SERVER_FORK_SERVER=0, or once it
is gone) they are interpreters started ahead, or fresh ones; with --replay-in thread none is started; an interpreter
whose server goes away before its arguments come exits quietly, as does one given no arguments; `discard` kills
those nobody took; `take` passes over one that died."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from gpu_server.replay import prestart
from gpu_server.replay.sandbox import InlineReplayer, ProcessReplayer, SandboxLimits
from gpu_server.replay.sandbox_wire import send
from protos import online_check_pb2 as pb
from protos.limits import MiB
from tests import support
from tests.test_hostile import RawStream, hello
from tests.test_sandbox import ended, fork_servers, job_of, relu, replay_workers, wait_for


def _ended(proc: subprocess.Popen, timeout: float = 120) -> int:
    return proc.wait(timeout=timeout)


def _check_three(server) -> None:
    stream = RawStream(server.port).send(hello(), *[f for seq in range(3) for f in relu(seq)])
    assert [a.status for a in stream.wait(3)] == [pb.Ack.ACCEPTED] * 3
    stream.close()


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("workers", [1, 2])
def test_the_server_s_workers_are_forked_by_its_fork_server(tmp_path, workers):
    # the command as a fresh interpreter (not forked from a helper that imported torch already: tests/zygote.py)
    with support.Server(str(tmp_path), args=("--workers", str(workers)), fresh=True) as server:
        forks = fork_servers(server.proc.pid)
        assert len(forks) == 1, forks                       # one fork server, whatever the worker count
        _is_a_fork_set_apart(forks[0], server.proc.pid)
        pids = wait_for(lambda: len(replay_workers(server.proc.pid)) == workers and replay_workers(server.proc.pid),
                        60, "the forked workers")
        assert len(pids) == workers, pids                   # the server's own children: it adopted them
        assert b"sandbox_worker" not in _cmdline(pids[0])   # forked (from the server), not a fresh interpreter
        _check_three(server)
        assert server.stop() == 0                  # drains: the three are checked
        # (a worker logs its start at its first request: the first record of its rank)
        assert server.log().count("worker process 1 started (forked)") == 1, server.log()
        ended(pids + forks, 10, "the workers and the fork server to end with the server")
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows


def _is_a_fork_set_apart(fork: int, server: int) -> None:
    """The fork server is a fork of the server (the command's interpreter, no new one), set apart as a fresh worker
    interpreter would be: a session of its own, no standard input, the project's folder, and of the socket pair only
    its own end (the server's closed in it, so the server closing its end is the fork server's end of input)."""
    assert _cmdline(fork) == _cmdline(server)
    assert os.getsid(fork) == fork and os.getsid(server) != fork
    assert os.readlink(f"/proc/{fork}/fd/0") == os.devnull
    assert os.readlink(f"/proc/{fork}/cwd") == prestart.ROOT
    links = _fd_links(fork)
    assert len([x for x in links if x.startswith("socket:")]) == 1, links


def _fd_links(pid: int) -> list[str]:
    """What `pid`'s open descriptors name. A descriptor may close between the listing and its read (the fork server
    holds a worker's pipe ends only while it forks that worker): those are left out."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return links


def test_without_the_fork_server_the_workers_are_the_interpreters_started_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv(prestart.FORK_SERVER_ENV, "0")
    with support.Server(str(tmp_path), args=("--workers", "2"), fresh=True) as server:
        assert fork_servers(server.proc.pid) == []
        # each names itself once it has imported torch (it may still be importing on a loaded host)
        pids = wait_for(lambda: len(replay_workers(server.proc.pid)) >= 2 and replay_workers(server.proc.pid),
                        60, "the two interpreters started ahead")
        assert len(pids) == 2, pids                # started before torch was imported: no more, none left over
        cmd = _cmdline(pids[0])
        assert b"gpu_server.replay.sandbox_worker" in cmd and b"--folder" not in cmd   # its arguments came by message
        _check_three(server)
        assert server.stop() == 0
        assert server.log().count("worker process 1 started (started ahead)") == 1, server.log()
        ended(pids, 10, "the workers to end with the server")
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows


@pytest.fixture
def fork_server_here():
    """A fork server started by this test process, as gpu-server starts its own (it adopts the forked workers). This
    process runs a thread (and may have run torch operations), so its fork server is an interpreter of its own, even
    asked to be a fork of it."""
    done = threading.Event()
    other = threading.Thread(target=done.wait, name="another-thread")
    other.start()
    try:
        prestart.start(1, fork=True)
    finally:
        done.set()
        other.join()
    try:
        assert prestart._forks is not None
        # (Popen returns once exec has begun; the kernel sets the new command line a moment later)
        wait_for(lambda: b"gpu_server.replay.fork_server" in _cmdline(prestart._forks.proc.pid), 10,
                 "the fork server interpreter's command line")
        yield prestart._forks
    finally:
        prestart.stop()
    assert prestart._forks is None


def test_replaced_workers_are_forked_and_once_the_fork_server_is_gone_started_fresh(fork_server_here):
    """The same replays from a forked worker, from the fork that replaces it after a kill, and from the fresh
    interpreter that replaces that one once the fork server is gone; each end is reported with its signal."""
    job = job_of(relu(0))
    want = InlineReplayer(torch.device("cpu")).forward(job, keep=False, match=True)
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        hows = []
        for generation in (1, 2, 3):
            got = proc.forward(job, keep=False, match=True)
            assert torch.equal(got.bench[0], want.bench[0]) and torch.equal(got.same[0], want.same[0])
            assert proc.generation == generation
            hows.append(proc._how)
            pid = proc._proc.pid
            assert replay_workers(os.getpid()) == [pid]     # this process's child, forked or not
            if generation == 2:
                fork_server_here.proc.kill()
                fork_server_here.proc.wait()
            os.kill(pid, signal.SIGKILL)
            ended([pid], 10, "the killed worker to end")
            assert proc._kill() == "signal SIGKILL"                 # its exit status, as a fresh worker's
        assert hows == ["forked", "forked", ""]
        assert proc.replaced == 2
    finally:
        proc.close()


def test_a_server_replaying_in_its_threads_starts_no_worker_process(tmp_path):
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as server:
        assert replay_workers(server.proc.pid) == []


def test_an_interpreter_whose_server_goes_away_first_exits_quietly():
    one = prestart.launch()
    os.close(one.to_child)
    one.to_child = -1
    assert _ended(one.proc) == 0
    one.close()


def test_an_interpreter_given_no_arguments_exits(tmp_path):
    one = prestart.launch()
    send(one.to_child, {"what": "not the arguments"})
    assert _ended(one.proc) == 0
    one.close()


def test_discard_kills_the_interpreters_nobody_took_and_take_passes_over_a_dead_one(monkeypatch):
    monkeypatch.setenv(prestart.FORK_SERVER_ENV, "0")
    prestart.start(3)
    try:
        dead = prestart._waiting[0]
        dead.proc.kill()
        dead.proc.wait()
        taken = prestart.take()                       # the dead one is passed over
        assert taken is not None and taken is not dead and taken.proc.poll() is None
        left = list(prestart._waiting)
        assert len(left) == 1
        prestart.discard()
        assert prestart._waiting == [] and left[0].proc.poll() is not None
        assert taken.proc.poll() is None              # taken: not the pool's to end
        taken.close()
        assert _ended(taken.proc) == 0
    finally:
        prestart.discard()
    assert prestart.take() is None


@pytest.mark.parametrize("forked", [True, False])
@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_the_replay_workers_openmp_threads_wait_passively_unless_the_user_says(tmp_path, monkeypatch, given, forked):
    """gpu_server/omp_wait.py: the replay workers' OpenMP threads wait with OMP_WAIT_POLICY=PASSIVE (idle, they sleep
    instead of spinning on the cores the server needs), or with the policy the user gave the server. What counts is
    what libgomp read when it was loaded, which it prints with OMP_DISPLAY_ENV: in `gpu-server` (the command, a fresh
    interpreter), which its fork server and the workers it forks inherit loaded; without the fork server, in each
    worker interpreter too. (A forked process's /proc/PID/environ shows the environment its parent started with.)"""
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    if not forked:
        monkeypatch.setenv(prestart.FORK_SERVER_ENV, "0")
    monkeypatch.setenv("OMP_DISPLAY_ENV", "TRUE")
    loads = 1 if forked else 2
    with support.Server(str(tmp_path), fresh=True) as server:
        wait_for(lambda: replay_workers(server.proc.pid), 60, "the replay worker process")
        wait_for(lambda: server.log().count("OPENMP DISPLAY ENVIRONMENT END") >= loads, 60, "libgomp's displays")
        assert server.stop() == 0
    policies = [line.split("=")[1].strip() for line in server.log().splitlines() if "OMP_WAIT_POLICY" in line]
    assert policies == [f"'{given or 'PASSIVE'}'"] * loads, server.log()


def test_the_command_line_sets_the_policy_before_torch_loads_openmp(tmp_path, monkeypatch):
    """gpu-server sets OMP_WAIT_POLICY for itself before it imports torch (libgomp reads it once, when loaded):
    here its first steps run in this process and stop at a missing config file."""
    from gpu_server import cli

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main(["--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")]) == 2
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_worker_the_fork_server_never_forks_counts_as_killed_without_waiting_for_it(monkeypatch):
    """A fork server still starting (or stuck) when the server stops a worker it asked for: `kill` waits
    KILL_WAIT_S for the fork, then counts the worker as killed, so a stopping server is not held by it."""
    from gpu_server.replay import fork_server

    monkeypatch.setattr(fork_server, "KILL_WAIT_S", 0.5)
    ours, theirs = socket.socketpair()
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=(theirs.fileno(),))
    theirs.close()
    client = fork_server.Client(silent, ours)
    try:
        r, w = os.pipe()
        worker = fork_server.ForkedWorker(client, client.fork(r, w), start_timeout=20)
        os.close(r)
        os.close(w)
        assert worker.poll() is None and worker.pid is None      # asked for, not forked yet: running, as far as known
        t0 = time.monotonic()
        worker.kill()
        assert worker.wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
    assert silent.returncode is not None                          # close ended the fork server
