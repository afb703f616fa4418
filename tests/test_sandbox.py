"""Replays in capped worker processes (gpu_server/replay/sandbox.py, docs/design.md §6.8): a replay that crashes, runs
out
of its memory cap or past its time limit costs its worker process and one SKIP row, never the server, a concurrent
training or a restart; the record is quarantined in the journal and never replayed again."""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import pytest
import torch

from gpu_server.replay.fork_server import FORK_SERVER_NAME, WORKER_NAME
from gpu_server.replay.sandbox import InlineReplayer, ProcessReplayer, SandboxLimits
from gpu_server.replay.sandbox_wire import ChannelClosed, read_leaves
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from tests import support
from tests.support import forked_replay_workers  # noqa: F401 - its replay workers forked (an autouse fixture)
from tests.test_hostile import RawStream, hello

MiB = 1 << 20
SVD_N = 1536       # a linalg_svd whose float64 bench run takes seconds on any CPU (and tens here)


def frames_of(name: str, fn, *args, run_id: str = "sandbox", seq: int = 0, **kwargs) -> list[bytes]:
    out = fn(*args, **kwargs)
    rec = PendingRecord(name=name, step=0, inputs=snapshot((args, kwargs)), output=snapshot(out), seq=seq)
    enc = encode_record(rec, run_id, 0)
    return list(enc.wire_frames(4 * MiB))


def slow_svd(seq: int, run_id: str = "sandbox") -> list[bytes]:
    torch.manual_seed(1)
    return frames_of(f"Torch.linalg_svd.{seq}", torch.linalg.svd, torch.randn(SVD_N, SVD_N), run_id=run_id, seq=seq)


def relu(seq: int, run_id: str = "sandbox") -> list[bytes]:
    return frames_of(f"Functional.relu.{seq}", torch.nn.functional.relu, torch.linspace(-2, 2, 64), run_id=run_id,
                     seq=seq)


def _children_named(server_pid: int, name: bytes) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm", "rb") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if ppid == server_pid and comm == name:
            pids.append(int(entry))
    return pids


def replay_workers(server_pid: int) -> list[int]:
    """The server's replay worker processes: its children named gpu-replay (gpu_server/replay/fork_server.py names
    them so, forked or started as gpu_server.replay.sandbox_worker)."""
    return _children_named(server_pid, WORKER_NAME)


def fork_servers(server_pid: int) -> list[int]:
    """The server's replay fork server (gpu_server/replay/fork_server.py), as a list."""
    return _children_named(server_pid, FORK_SERVER_NAME)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(cond, timeout: float = 120, what: str = ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def replaying(server: support.Server, worker: int) -> None:
    """Wait until `worker` has started (the server logs it once the worker is ready: its start-up imports torch,
    which costs CPU too) and has then spent a second of CPU replaying."""
    wait_for(lambda: "worker process 1 started" in server.log(), 180, "the replay worker to be ready")
    base = cpu_seconds(worker)
    wait_for(lambda: cpu_seconds(worker) > base + 1.0, 120, "the replay to run")


def rows_named(out: str, prefix: str) -> dict[str, dict]:
    return {r["API Name"]: r for r in support.read_csv(out, "accuracy_checking_details")
            if r["API Name"].startswith(prefix)}


def transport_counts(out: str) -> dict:
    [path] = glob.glob(os.path.join(out, "summary_*.json"))
    with open(path) as fh:
        return json.load(fh)["transport"]


def journal_lines(out: str) -> list[dict]:
    with open(os.path.join(out, "spool", "journal.log")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_a_crashing_replay_costs_one_skip_row_while_a_training_is_checked_and_a_restart_does_not_replay_it(tmp_path):
    with support.Server(str(tmp_path), args=("--replay-timeout-s", "600")) as server:
        [worker] = wait_for(lambda: replay_workers(server.proc.pid), 60, "the replay worker process")
        stream = RawStream(server.port).send(hello(), *slow_svd(0))
        assert [a.status for a in stream.wait(1)] == [pb.Ack.ACCEPTED]
        # the svd's replay is running in the worker process: crash it there, as a bad native kernel would
        replaying(server, worker)
        training = support.Training(support.SMALL_TRAIN, support.agent_config(str(tmp_path / "agent.json"),
                                                                               server.port))
        os.kill(worker, signal.SIGSEGV)
        assert training.result(300).returncode == 0
        row = wait_for(lambda: rows_named(server.out, "Torch.linalg_svd.0").get("Torch.linalg_svd.0.forward.output.0"),
                       120, "the svd's row")
        assert row["Status"] == "SKIP"
        assert "killed its worker process (signal SIGSEGV" in row["Message"] and "quarantined" in row["Message"]
        [replacement] = wait_for(lambda: replay_workers(server.proc.pid), 60, "the replacement worker")
        assert replacement != worker
        assert any(line.get("q") and line["q"][0][:3] == ["sandbox", 0, 0] for line in journal_lines(server.out))
        stream.close()
        assert server.stop() == 0    # drains: every record of the training is checked
    # the training beside it was checked in full, by the replacement worker
    details = support.read_csv(server.out, "accuracy_checking_details")
    trained = [r for r in details if not r["API Name"].startswith("Torch.linalg_svd")]
    assert len(trained) >= 10 and all(r["Status"] == "pass" for r in trained), [
        (r["API Name"], r["Message"]) for r in trained if r["Status"] != "pass"]
    assert transport_counts(server.out)["replay_workers_replaced"] == 1
    # a restart on the same --out: the record is done (its SKIP row is journaled), nothing is replayed again
    with support.Server(str(tmp_path), out=server.out) as again:
        assert again.stop() == 0
    assert len([r for r in support.read_csv(server.out, "accuracy_checking_details")
                if r["API Name"].startswith("Torch.linalg_svd.0")]) == 1


def test_a_record_quarantined_before_the_server_died_is_reported_skip_at_restart_never_replayed(tmp_path):
    out = str(tmp_path / "out")
    server = support.Server(str(tmp_path), out=out, args=("--replay-timeout-s", "600")).start()
    stream = RawStream(server.port).send(hello(), *slow_svd(0))
    assert [a.status for a in stream.wait(1)] == [pb.Ack.ACCEPTED]
    [worker] = wait_for(lambda: replay_workers(server.proc.pid), 60, "the replay worker process")
    replaying(server, worker)
    # the server dies while the worker replays; its journal had quarantined the record (as it does when a replay
    # kills its worker, before the SKIP row is written)
    server.kill()
    stream.close()
    with open(os.path.join(out, "spool", "journal.log"), "a") as fh:
        fh.write(json.dumps({"q": [["sandbox", 0, 0, "its worker process died with signal SIGSEGV"]]}) + "\n")
    t0 = time.time()
    with support.Server(str(tmp_path), out=out, port=support.free_port()) as again:
        row = wait_for(lambda: rows_named(out, "Torch.linalg_svd.0").get("Torch.linalg_svd.0.forward.output.0"),
                       60, "the quarantined record's row")
        assert row["Status"] == "SKIP" and "killed a replay worker before the restart" in row["Message"]
        assert "SIGSEGV" in row["Message"]
        workers = wait_for(lambda: replay_workers(again.proc.pid), 60, "the replay worker process")
        assert workers and all(cpu_seconds(w) < 30 for w in workers)   # nothing replayed the svd
        assert again.stop() == 0
    assert time.time() - t0 < 120


def test_a_replay_past_the_memory_cap_is_skip_naming_the_option_and_the_worker_goes_on(tmp_path):
    torch.manual_seed(0)
    a, b = torch.randn(2048, 1024), torch.randn(1024, 2048)   # float64 bench: 16 + 16 + 32 MiB, above the cap
    with support.Server(str(tmp_path), args=("--replay-memory-mb", "16")) as server:
        training = support.Training(support.SMALL_TRAIN, support.agent_config(str(tmp_path / "agent.json"),
                                                                               server.port))
        stream = RawStream(server.port).send(hello(), *frames_of("Torch.mm.0", torch.mm, a, b, seq=0), *relu(1))
        assert len(stream.wait(2)) == 2
        assert training.result(300).returncode == 0
        stream.close()
        assert server.stop() == 0
    rows = rows_named(server.out, "")
    mm = rows["Torch.mm.0.forward.output.0"]
    assert mm["Status"] == "SKIP" and "--replay-memory-mb 16" in mm["Message"], mm["Message"]
    assert rows["Functional.relu.1.forward.output.0"]["Status"] == "pass"
    # the training beside it was checked in full by the same worker process
    trained = [r for name, r in rows.items() if not name.startswith(("Torch.mm.0", "Functional.relu.1"))]
    assert len(trained) >= 10 and all(r["Status"] == "pass" for r in trained), [
        (r["API Name"], r["Message"]) for r in trained if r["Status"] != "pass"]
    assert transport_counts(server.out)["replay_workers_replaced"] == 0


def test_a_slow_replay_is_cut_at_its_time_limit_and_the_next_record_is_checked(tmp_path):
    with support.Server(str(tmp_path), args=("--replay-timeout-s", "1")) as server:
        t0 = time.time()
        # a record answered before the slow one: the stopped worker leaves its answer arena behind
        stream = RawStream(server.port).send(hello(), *relu(0), *slow_svd(1), *relu(2))
        assert len(stream.wait(3)) == 3
        rows = wait_for(lambda: (lambda r: r if len(r) == 3 else None)(rows_named(server.out, "")), 120, "rows")
        svd = rows["Torch.linalg_svd.1.forward.output.0"]
        assert svd["Status"] == "SKIP" and "--replay-timeout-s 1" in svd["Message"], svd["Message"]
        assert rows["Functional.relu.0.forward.output.0"]["Status"] == "pass"
        relu2 = rows["Functional.relu.2.forward.output.0"]
        assert relu2["Status"] == "pass", relu2
        assert time.time() - t0 < 90
        stream.close()
        assert server.stop() == 0
    assert transport_counts(server.out)["replay_workers_replaced"] == 1


# -- the replayer itself --------------------------------------------------------------------------------------------
def job_of(frames: list[bytes]):
    from gpu_server.decode import decode_job
    from gpu_server.intake.assembler import FrameAssembler
    from protos import online_check_pb2 as pb

    asm = FrameAssembler()
    done = None
    for f in frames:
        done = asm.feed(pb.Frame.FromString(f))
    return decode_job(*done)


def test_process_and_inline_replays_give_the_same_outputs():
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    rec = PendingRecord(name="Functional.linear.0", step=0, inputs=snapshot(((x, w), {})),
                        output=snapshot(torch.nn.functional.linear(x, w)), seq=0)
    enc = encode_record(rec, "same", 0)
    job = job_of(list(enc.wire_frames(MiB)))
    inline = InlineReplayer(torch.device("cpu")).forward(job, keep=False, match=True)
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), torch.get_num_threads(), 64 * MiB)
    try:
        remote = proc.forward(job, keep=False, match=True)
    finally:
        proc.close()
    assert len(inline.bench) == len(remote.bench) == 1
    assert inline.bench[0].dtype == remote.bench[0].dtype == torch.float64
    assert torch.equal(inline.bench[0], remote.bench[0]) and torch.equal(inline.same[0], remote.same[0])
    assert not os.path.exists(proc.folder)


def test_an_answer_that_does_not_fit_its_arena_is_refused():
    arena = memoryview(bytearray(16))
    with pytest.raises(ChannelClosed, match="does not fit"):
        read_leaves([[{"t": ["float32", [8], 0, 32]}]], arena)
    with pytest.raises(ChannelClosed, match="does not fit"):
        read_leaves([[{"t": ["float32", [2], 12, 8]}]], arena)
    with pytest.raises(ChannelClosed, match="unknown kind"):
        read_leaves([[{"pickle": "x"}]], arena)
    assert read_leaves([[{"t": ["float32", [2], 8, 8]}, {"v": 3}, {"f": "nan"}]], arena)[0][1] == 3


def test_a_worker_that_dies_between_requests_is_replaced_on_the_next_one():
    job = job_of(relu(0))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        proc.ready()
        os.kill(proc._proc.pid, signal.SIGKILL)
        proc._proc.wait()
        # it ended before this request was sent: the request did not end it, and is replayed by the next process
        assert proc.forward(job, keep=False, match=True).bench[0].shape == (64,)
        assert proc.replaced == 1
    finally:
        proc.close()


def test_a_worker_killed_after_it_answered_is_replaced_and_its_arenas_do_not_stop_the_next_one():
    """A worker stopped by the time limit or a crash after earlier answers leaves its answer arena in the folder;
    its replacement names its arenas from out-0 again and must still answer (before: FileExistsError on every later
    request)."""
    job = job_of(relu(0))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        first = proc.forward(job, keep=False, match=True).bench[0]
        assert "out-0" in os.listdir(proc.folder)
        os.kill(proc._proc.pid, signal.SIGKILL)
        proc._proc.wait()
        for _ in range(2):
            assert torch.equal(proc.forward(job, keep=False, match=True).bench[0], first)
        assert proc.replaced == 1
    finally:
        proc.close()


def test_a_backward_whose_graphs_died_with_their_worker_replays_its_forward_in_the_next_one():
    """Kept graphs live in the process that replayed the forward. Once it has ended, its handles mean nothing to
    the next process: the backward goes with its forward record and replays it (before, the new process got the
    old handles without the forward, stopped on the request, and an innocent record was quarantined)."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with support.capture() as (mode, sink):
        with mode:
            y = torch.nn.functional.linear(x, lin.weight, lin.bias)
        y.sum().backward()
    fwd, bwd = (support.to_job(r) for r in (sink.forward("Functional.linear.0"), sink.backward("Functional.linear.0")))
    inline = InlineReplayer(torch.device("cpu"))
    want = inline.backward(fwd, bwd, inline.forward(fwd, keep=True, match=True).kept, match=True)
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        kept = proc.forward(fwd, keep=True, match=True).kept
        assert kept is not None and kept.bench is not None
        os.kill(proc._proc.pid, signal.SIGKILL)
        proc._proc.wait()
        got = proc.backward(fwd, bwd, kept, match=True)
        assert proc.replaced == 1
    finally:
        proc.close()
    for g, w in zip(got.bench + got.same, want.bench + want.same):
        assert (g is None and w is None) or torch.equal(g, w)


def test_a_replay_worker_outlives_signals_sent_to_the_servers_process_group():
    """The worker process is in a session of its own and ignores SIGINT and SIGTERM: the server, which drains on
    them, decides when it ends (tests/test_sandbox.py's end-to-end test below sends them to the whole group)."""
    job = job_of(relu(0))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        proc.ready()
        pid = proc._proc.pid
        assert os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgid(0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(pid, sig)
        time.sleep(0.3)
        assert proc._proc.poll() is None
        assert proc.forward(job, keep=False, match=True).bench[0].shape == (64,)
        assert proc.replaced == 0
    finally:
        proc.close()
    assert proc._proc is None   # closed by its exit message (or killed) all the same


def test_a_replay_worker_ends_with_its_server_even_mid_replay(tmp_path):
    """kill -9 of the server while its worker replays a record that takes a minute: the worker ends at once
    (its parent-death signal), not when the replay is done; with its own session and SIGTERM ignored, nothing else
    would stop it, and a replay that never ends would run forever."""
    server = support.Server(str(tmp_path), args=("--replay-timeout-s", "600"), session=True).start()
    try:
        [worker] = wait_for(lambda: replay_workers(server.proc.pid), 60, "the replay worker process")
        # an svd whose float64 replay takes about a minute here (its recorded output is not what is measured)
        torch.manual_seed(1)
        n = 2 * SVD_N
        frames = frames_of("Torch.linalg_svd.0", lambda a: (torch.zeros(n, n), torch.zeros(n), torch.zeros(n, n)),
                           torch.randn(n, n))
        stream = RawStream(server.port).send(hello(), *frames)
        assert [a.status for a in stream.wait(1)] == [pb.Ack.ACCEPTED]
        replaying(server, worker)
        forks = fork_servers(server.proc.pid)
        assert len(forks) == 1, forks
        server.proc.kill()
        server.proc.wait()
        ended([worker], 3, "the worker to end")
        # and its fork server (gpu_server/replay/fork_server.py), idle, also by its parent-death signal
        ended(forks, 3, "the fork server to end")
        stream.close()
    finally:
        server.kill()


def ended(pids: list[int], timeout: float, what: str) -> None:
    """Wait until every process of `pids` is gone or a zombie (ended, not yet waited for)."""
    wait_for(lambda: all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids), timeout, what)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_to_the_servers_whole_process_group_drains_every_record(tmp_path):
    """Ctrl-C in a terminal, `timeout` and `kill -- -PGID` signal every process of the server's group (systemd's
    default KillMode, every process of its cgroup). The server drains; its replay worker must not die under it:
    before, the replay in flight was quarantined as a crash (a SKIP row), and the next backward, sent to a new
    worker with the dead one's graph handles, stopped that one too."""
    from tests.test_durability import TRAIN, check_exactly_once, counts_of, summary_of

    work = str(tmp_path)
    nfs = os.path.join(work, "nfs")
    os.makedirs(nfs)
    steps = 6
    proc = support.run_training(TRAIN, support.agent_config(os.path.join(work, "agent.json"), nfs_path=nfs),
                                str(steps), "0", "1", "96", timeout=180)
    counts = counts_of(proc)
    srv = support.Server(work, nfs_path=nfs, session=True).start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not glob.glob(os.path.join(srv.out, "accuracy_checking_details_*")):
            time.sleep(0.05)
        os.killpg(os.getpgid(srv.proc.pid), signal.SIGTERM)
        code = srv.proc.wait(timeout=240)
    finally:
        srv.kill()
    assert code == 0, srv.log()[-3000:]
    summary = summary_of(srv.out)
    assert summary["quarantined_records"] == [], summary["quarantined_records"]
    assert not summary["transport"].get("replay_workers_replaced"), summary["transport"]
    assert sum(summary["records_received"].values()) == counts["captured"]
    check_exactly_once(srv.out, 0, steps)


def test_concurrent_requests_on_one_replayer_are_serialised():
    job = job_of(relu(0))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    results: list = []
    try:
        threads = [threading.Thread(target=lambda: results.append(proc.forward(job, False, True))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        proc.close()
    assert len(results) == 4 and all(torch.equal(r.bench[0], results[0].bench[0]) for r in results)


@pytest.mark.parametrize("mode,warmed", [("process", 0), ("thread", 1)])
def test_the_server_loads_the_meta_kernels_only_where_it_replays(tmp_path, monkeypatch, mode, warmed):
    """The replays' meta dry runs need torch's meta kernels (about 0.6 s of CPU and 38 MB to load): the server's own
    process loads them at start only with --replay-in thread; replay worker processes load them at their start."""
    from gpu_server.checking import workers
    from gpu_server.checking.pending import PendingCalls
    from gpu_server.reports.summary import Summary

    calls: list[int] = []
    monkeypatch.setattr(workers.replay, "warm_up", lambda: calls.append(1))
    pool = workers.WorkerPool([], str(tmp_path), "20260101000000", Summary(), PendingCalls(1 << 20),
                              sandbox=SandboxLimits(mode))
    pool.drain_and_stop()
    assert len(calls) == warmed
