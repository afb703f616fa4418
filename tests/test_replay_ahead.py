"""One replay ahead (gpu_server/replay/sandbox.py `ProcessReplayer.prefetch`, docs/design.md §6.8): while a server
worker compares one call's outputs, its worker process already replays the next forward job of its queue. The rows
are the same as without it; the answer goes to the job it was sent for and to no other; a crash or the time limit
during a replay sent ahead costs that record, never the one being compared."""
from __future__ import annotations

import os
import re
import select
import signal
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from gpu_server.checking.checker import Checker
from gpu_server.checking.pending import PendingCalls
from gpu_server.checking.workers import Worker
from gpu_server.replay.sandbox import InlineReplayer, ProcessReplayer, SandboxLimits, WorkerLost
from gpu_server.reports.rank_reports import Reports
from gpu_server.reports.summary import Summary
from tests.support import capture, forked_replay_workers, to_job  # noqa: F401 - its replay workers forked
from tests.test_sandbox import cpu_seconds, frames_of, job_of, relu, slow_svd

MiB = 1 << 20
CPU = torch.device("cpu")


def _replayer(timeout_s: float = 120.0) -> ProcessReplayer:
    return ProcessReplayer(CPU, SandboxLimits(timeout_s=timeout_s), 1, 512 * MiB)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
                                    for x, y in zip(a, b))


def _answered(proc: ProcessReplayer, timeout: float = 60.0) -> bool:
    """The worker process has written an answer nobody asked for yet."""
    return bool(select.select([proc._r], [], [], timeout)[0])


def _linear(seed: int):
    torch.manual_seed(seed)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    with capture() as (mode, sink):
        with mode:
            F.linear(x, w).sum().backward()
    return to_job(sink.forward("Functional.linear.0"))


def test_a_forward_sent_ahead_is_replayed_before_it_is_asked_for_and_answers_its_own_job():
    a, b = job_of(relu(0)), _linear(1)
    inline = InlineReplayer(CPU)
    proc = _replayer()
    try:
        proc.forward(a, keep=False, match=True)
        proc.prefetch(b, keep=True, match=True)
        assert _answered(proc)                     # replayed while nobody waited for it
        got = proc.forward(b, keep=True, match=True)
        assert proc._ahead is None and proc.replaced == 0
    finally:
        proc.close()
    want = inline.forward(b, keep=True, match=True)
    assert _same(got.bench, want.bench) and _same(got.same, want.same)
    assert got.kept is not None and got.kept.bench is not None


def test_the_spread_runs_of_the_compared_call_keep_the_answer_ahead():
    a, b = job_of(relu(0)), _linear(2)
    inline = InlineReplayer(CPU)
    proc = _replayer()
    sent = []
    send = proc._send
    proc._send = lambda op, jobs, fields: sent.append(op) or send(op, jobs, fields)
    try:
        proc.forward(a, keep=False, match=True)
        proc.prefetch(b, keep=False, match=True)
        members = proc.forward_members(a, match=True)   # asked while `b` is ahead
        got = proc.forward(b, keep=False, match=True)
    finally:
        proc.close()
    assert sent == ["forward", "forward", "spread_forward"]   # `b` replayed once, ahead
    assert members and all(len(m) == 1 and m[0].shape == (64,) for m in members)
    want = inline.forward(b, keep=False, match=True)
    assert _same(got.bench, want.bench) and _same(got.same, want.same)


@pytest.mark.parametrize("other", ["another job", "other settings"])
def test_an_answer_ahead_that_is_not_asked_for_is_let_go_and_the_request_runs(other):
    a, b, c = job_of(relu(0)), _linear(3), _linear(4)
    inline = InlineReplayer(CPU)
    proc = _replayer()
    sent = []
    send = proc._send
    proc._send = lambda op, jobs, fields: sent.append((op, list(proc._drops))) or send(op, jobs, fields)
    try:
        proc.forward(a, keep=False, match=True)
        proc.prefetch(b, keep=True, match=True)
        asked = c if other == "another job" else b
        got = proc.forward(asked, keep=False, match=True)
        assert got.kept is None
        again = proc.forward(b, keep=True, match=True)        # nothing of the answer let go is taken again
    finally:
        proc.close()
    assert [op for op, _ in sent] == ["forward"] * 4
    assert len(sent[2][1]) == 2                               # its kept graphs (bench, same) dropped in the worker
    assert _same(got.bench, inline.forward(asked, keep=False, match=True).bench)
    assert _same(again.bench, inline.forward(b, keep=True, match=True).bench) and again.kept is not None


def test_a_replay_ahead_that_kills_its_worker_costs_its_own_record_not_the_one_compared():
    a, svd = job_of(relu(0)), job_of(slow_svd(1))
    proc = _replayer(timeout_s=600)
    try:
        proc.forward(a, keep=False, match=True)
        pid = proc._proc.pid
        cpu0 = cpu_seconds(pid)
        proc.prefetch(svd, keep=False, match=True)
        deadline = time.monotonic() + 60
        while cpu_seconds(pid) < cpu0 + 0.5 and time.monotonic() < deadline:   # it is replaying the svd
            time.sleep(0.05)
        os.kill(pid, signal.SIGSEGV)
        members = proc.forward_members(a, match=True)   # the compared call's spread: a new worker runs it
        assert members and proc.replaced == 1
        with pytest.raises(WorkerLost, match=r"killed its worker process \(signal SIGSEGV"):
            proc.forward(svd, keep=False, match=True)
        assert proc.forward(a, keep=False, match=True).bench[0].shape == (64,)
    finally:
        proc.close()


def test_the_time_limit_of_a_replay_ahead_counts_from_when_it_was_sent():
    """Asked for after its limit, a replay still running gets at most a second more (its answer may be on its way),
    not a limit of its own again."""
    torch.manual_seed(1)
    svd = job_of(frames_of("Torch.linalg_svd.1", torch.linalg.svd, torch.randn(2048, 2048), seq=1))   # 5-20 s
    a = job_of(relu(0))
    proc = _replayer(timeout_s=2)
    try:
        proc.forward(a, keep=False, match=True)
        proc.prefetch(svd, keep=False, match=True)
        time.sleep(2.2)   # the compared call's rows take this long
        asked = time.monotonic()
        with pytest.raises(WorkerLost, match=r"--replay-timeout-s 2: the replay was stopped after") as err:
            proc.forward(svd, keep=False, match=True)
        assert time.monotonic() - asked < 1.9   # not another 2 s
        assert int(re.search(r"stopped after (\d+) s", str(err.value)).group(1)) >= 3
        assert proc.forward(a, keep=False, match=True).bench[0].shape == (64,) and proc.replaced == 1
    finally:
        proc.close()


def _rows(jobs: list, tmp: str, ahead: bool) -> tuple[dict[str, str], list[str]]:
    """Every job through a server worker (PendingCalls, Checker, Reports) replaying in a worker process, with the
    next forward job sent ahead as gpu_server/checking/workers.py does, or not; the report files' text and the ops
    the worker process was sent."""
    summary = Summary()
    pending = PendingCalls(1 << 30)
    proc = _replayer()
    sent: list[str] = []
    send, take = proc._send, proc._take_ahead
    proc._send = lambda op, jobs_, fields: sent.append(op) or send(op, jobs_, fields)
    proc._take_ahead = lambda op, jobs_, fields: (lambda got: (got is not None and sent.append("taken")) or got)(
        take(op, jobs_, fields))
    checker = Checker(CPU, summary, replayer=proc)
    queue = list(jobs)
    if ahead:
        checker.upcoming = lambda: ((queue[0], pending.keeps(queue[0]))
                                    if queue and queue[0].direction != 2 and not queue[0].skip_reason else None)
    worker = Worker(checker, Reports(tmp, "ts", summary.add_files), pending)
    torch.set_grad_enabled(False)   # as in the worker threads
    try:
        while queue:
            worker.check(queue.pop(0))
        worker.close()
    finally:
        torch.set_grad_enabled(True)
    files = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".csv"):
            with open(os.path.join(tmp, f), encoding="utf-8") as fh:
                files[f] = fh.read()
    return files, sent


def test_a_training_checked_with_replays_ahead_has_the_same_rows_and_replays_each_call_once():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with capture() as (mode, sink):
        with mode:
            loss = F.cross_entropy(model(x), torch.arange(8) % 4)
        loss.backward()
    for seq, rec in enumerate(sink):
        rec.seq = seq
    jobs = [to_job(r) for r in sink]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        plain, plain_ops = _rows(jobs, a, ahead=False)
        ahead, ahead_ops = _rows(jobs, b, ahead=True)
    assert plain and ahead == plain
    # no forward replayed twice, none left out; each forward after a replayed call was sent ahead and taken
    assert [op for op in ahead_ops if op != "taken"] == plain_ops and "taken" not in plain_ops
    after_forward = [j for i, j in enumerate(jobs) if i and j.direction != 2 and not j.skip_reason
                     and jobs[i - 1].direction != 2 and not jobs[i - 1].skip_reason]
    assert len(after_forward) >= 5 and ahead_ops.count("taken") == len(after_forward)
