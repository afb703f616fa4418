"""Replay worker interpreters started ahead (gpu_server/replay/prestart.py): gpu-server starts --workers of them before
it imports torch and its workers take exactly those (no other worker process, none left over) and check records;
with --replay-in thread none is started; an interpreter whose server goes away before its arguments come exits
quietly, as does one given no arguments; `discard` kills those nobody took; `take` passes over one that
died."""
from __future__ import annotations

import os
import subprocess

import pytest

from gpu_server.replay import prestart
from gpu_server.replay.sandbox_wire import send
from protos import online_check_pb2 as pb
from tests import support
from tests.test_hostile import RawStream, hello
from tests.test_sandbox import relu, replay_workers


def _ended(proc: subprocess.Popen, timeout: float = 120) -> int:
    return proc.wait(timeout=timeout)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_server_s_workers_are_the_interpreters_it_started_ahead(tmp_path, workers):
    # the command as a fresh interpreter (not forked from a helper that imported torch already: tests/zygote.py)
    with support.Server(str(tmp_path), args=("--workers", str(workers)), fresh=True) as server:
        pids = replay_workers(server.proc.pid)
        assert len(pids) == workers, pids          # started before torch was imported: no more, none left over
        with open(f"/proc/{pids[0]}/cmdline", "rb") as fh:
            assert b"--folder" not in fh.read()     # its arguments came by message
        stream = RawStream(server.port).send(hello(), *[f for seq in range(3) for f in relu(seq)])
        assert [a.status for a in stream.wait(3)] == [pb.Ack.ACCEPTED] * 3
        stream.close()
        assert server.stop() == 0                  # drains: the three are checked
        # (a worker logs its start at its first request: the first record of its rank)
        assert server.log().count("worker process 1 started ahead") == 1, server.log()
        assert sorted(p for p in pids if os.path.exists(f"/proc/{p}")) == []   # ended with the server
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows


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


def test_discard_kills_the_interpreters_nobody_took_and_take_passes_over_a_dead_one():
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


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_the_replay_workers_openmp_threads_wait_passively_unless_the_user_says(tmp_path, monkeypatch, given):
    """gpu_server/omp_wait.py: a replay worker's environment has OMP_WAIT_POLICY=PASSIVE (its idle OpenMP threads
    sleep instead of spinning on the cores the server needs), or the policy the user gave the server."""
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    with support.Server(str(tmp_path)) as server:
        pids = replay_workers(server.proc.pid)
        with open(f"/proc/{pids[0]}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        assert env.get(b"OMP_WAIT_POLICY") == (given or "PASSIVE").encode()
        assert server.stop() == 0


def test_the_command_line_sets_the_policy_before_torch_loads_openmp(tmp_path, monkeypatch):
    """gpu-server sets OMP_WAIT_POLICY for itself before it imports torch (libgomp reads it once, when loaded):
    here its first steps run in this process and stop at a missing config file."""
    from gpu_server import cli

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main(["--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")]) == 2
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
