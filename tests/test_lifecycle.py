"""A call's lifecycle across stops, restarts and damage (issue 11: findings 3 and 7, the medium and low findings):
real gpu-server processes, real gRPC or real shared folders, real spool files.

- SIGTERM while calls wait for their backward record: they stay in the spool and every call has one result row
  after the restart (also with the journal truncated to 20 bytes in between);
- a poison record, a damaged record and garbage in a spool segment: the restart quarantines them with SKIP rows;
- 300 ranks under `ulimit -n 1024`: every rank gets its reports;
- a 20 MB tmpfs as --out filled up mid-run: the server waits (no SKIP, no half row, no temporary file);
- evidence per run and `--error-data-max-mb`; an --out that cannot be created.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import time

import pytest
import torch

from gpu_server.reports import files as report_files
from tests.support import PY, Server, Training, agent_config, read_csv
from tests.test_durability import summary_of


class _Acks:
    """The transport's events, as the Sender would take them: nothing to do here."""

    def on_ack(self, seq: int, status: str, reason: str, count: int = 1) -> None:
        pass

    def on_reconnect(self, generation: int) -> None:
        pass

    def on_refused(self, refusal) -> None:
        raise AssertionError(f"the folder transport refused: {refusal}")


def _send_one(nfs: str, run_id: str, rank: int, ranks: int, rec) -> None:
    """One record and the end marker of (run_id, rank) through the real folder transport."""
    from npu_agent.transport import Counts, end_frame
    from npu_agent.transport_folder import FolderTransport

    transport = FolderTransport(nfs, run_id, rank, ranks)
    transport.start(_Acks())
    assert transport.send_records([rec], transport.generation)
    transport.send_end(end_frame(transport.identity, Counts(captured=1, sent=1, acknowledged=1), 1), 5)

# argv: config, go-file. Forward of a small MLP, then waits for the go-file before the backward.
WAIT_FOR_BACKWARD = r'''
import os, sys, time, json
import torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
cfg, go = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
dbg = PrecisionDebugger(config_path=cfg)
x, y = torch.randn(4, 32), torch.randint(0, 8, (4,))
dbg.start()
loss = F.cross_entropy(model(x), y)
print("FORWARD DONE", flush=True)
deadline = time.time() + 120
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.05)
loss.backward()
dbg.stop()
dbg.step()
print("COUNTS " + json.dumps(dbg.close() or {}))
'''


def _forward_rows(out: str) -> int:
    return sum(".forward." in r["API Name"] for r in read_csv(out, "accuracy_checking_details"))


def _settled(out: str, minimum: int, timeout: float = 60) -> int:
    """Wait until the forward detail rows stop growing (at least `minimum`)."""
    deadline, last, since = time.time() + timeout, -1, time.time()
    while time.time() < deadline:
        n = _forward_rows(out)
        if n != last:
            last, since = n, time.time()
        elif n >= minimum and time.time() - since > 1.5:
            return n
        time.sleep(0.1)
    raise AssertionError(f"forward rows did not settle: {last}")


@pytest.mark.parametrize("damage_journal", [False, True], ids=["journal-intact", "journal-truncated-to-20-bytes"])
def test_sigterm_while_calls_wait_for_backward_then_restart_reports_every_call_once(tmp_path, damage_journal):
    work = str(tmp_path)
    out, go = os.path.join(work, "out"), os.path.join(work, "go")
    first = Server(work, out=out).start()
    cfg = agent_config(os.path.join(work, "agent.json"), first.port, online_max_retry_s=0.3,
                       online_close_timeout_s=60)
    t = Training(WAIT_FOR_BACKWARD, cfg, go, timeout=120)
    _settled(out, 3)
    assert not read_csv(out, "accuracy_checking_result"), "no call may be complete before its backward"
    assert first.stop() == 0                     # SIGTERM while every call waits for its backward record
    assert glob.glob(os.path.join(out, "spool", "seg-*.spl")), "the waiting forward records left the spool"
    assert "stay in the spool" in first.log()
    if damage_journal:
        journal = os.path.join(out, "spool", "journal.log")
        os.truncate(journal, 20)
        sizes = {p: os.path.getsize(p) for p in glob.glob(os.path.join(out, "*.csv"))}
    second = Server(work, port=first.port, out=out).start()
    if damage_journal:
        assert {p: os.path.getsize(p) for p in sizes} == sizes, "a damaged journal must not cut the reports"
    open(go, "w").close()
    t.result(120)
    assert second.stop() == 0
    results = read_csv(out, "accuracy_checking_result")
    names = collections.Counter(r["API name"] for r in results)
    assert names and all(n == 1 for n in names.values()), names
    details = read_csv(out, "accuracy_checking_details")
    forward = collections.Counter(r["API Name"].split(".forward.")[0] for r in details if ".forward." in r["API Name"])
    assert set(forward) == set(names), (forward, names)        # every call with forward rows has its result row
    linear = [r for r in results if r["API name"].startswith("Functional.linear.")]
    assert len(linear) == 2 and all(r["Backward Test Success"] == "pass" for r in linear), linear
    assert all("never arrived" not in r["Message"] for r in results), results
    assert not glob.glob(os.path.join(out, "spool", "seg-*.spl"))
    if damage_journal:
        assert "journal is damaged" in second.log()
        assert glob.glob(os.path.join(out, "spool", "journal.log.damaged-*"))


# -- the spool on a restart ------------------------------------------------------------------------------------


def _captured_add(run: str, rank: int, seq: int, shape=(2, 2)):
    """A real captured `torch.add` call as (Record, payload), through the real wire encoding."""
    from gpu_server.intake.assembler import FrameAssembler
    from npu_agent.records import encode_record
    from protos import online_check_pb2 as pb
    from tests.support import capture

    a, b = torch.randn(*shape), torch.randn(*shape)
    with capture(backward=False) as (mode, sink):
        with mode:
            torch.add(a, b)
    rec = sink.forward("Torch.add.0")
    rec.seq = seq
    enc = encode_record(rec, run, rank)
    asm, done = FrameAssembler(), None
    for frame in enc.wire_frames(1 << 20):
        done = asm.feed(pb.Frame.FromString(frame))
    return done[0], bytearray(done[1])


def test_poison_damaged_and_garbage_spool_records_are_quarantined_on_restart(tmp_path):
    from gpu_server.spool.segments import MAGIC, entry_bytes, segment_path

    work = str(tmp_path)
    out = os.path.join(work, "out")
    spool = os.path.join(out, "spool")
    os.makedirs(spool)
    good = _captured_add("run1", 0, 0)
    poison = _captured_add("run1", 0, 1)
    del poison[0].tensors[0].stride[:]
    poison[0].tensors[0].stride.extend([0, 0])          # finding 3: stride=[0,0] for shape [2,2]
    damaged = _captured_add("run1", 0, 2)
    after = _captured_add("run1", 0, 3)
    with open(segment_path(spool, 0), "wb") as fh:
        fh.write(MAGIC)
        for i, (record, payload) in enumerate((good, poison, damaged, after)):
            header = record.SerializeToString()
            head = entry_bytes(header, payload)
            if i == 2:
                payload = bytearray(payload)
                payload[0] ^= 0xFF                      # payload checksum no longer holds
            if i == 3:
                fh.write(b"REC1 garbage that is no entry")   # damage between two entries
            fh.write(head + header + bytes(payload))
    with Server(work, out=out) as server:
        pass
    assert server.proc.returncode == 0, server.log()
    assert "Traceback" not in server.log() and "quarantined" in server.log(), server.log()
    rows = read_csv(out, "accuracy_checking_result")
    by_status = collections.Counter(r["Forward Test Success"] for r in rows)
    assert by_status == {"pass": 2, "SKIP": 2}, rows
    skips = [r["Message"] for r in rows if r["Forward Test Success"] == "SKIP"]
    assert any("checksum" in m and "quarantined" in m for m in skips), skips
    summary = summary_of(out)
    assert summary["durability"]["spool_damaged_regions"] == 1, summary["durability"]
    assert any(q["why"].count("checksum") for q in summary["quarantined_records"]), summary["quarantined_records"]
    assert os.listdir(os.path.join(spool, "damaged")) == ["seg-000000000.spl"]
    assert not glob.glob(os.path.join(spool, "seg-*.spl"))
    with Server(work, out=out) as again:              # nothing checked or written twice on the next start
        pass
    assert again.proc.returncode == 0
    assert len(read_csv(out, "accuracy_checking_result")) == 4


# -- many ranks, few file descriptors ----------------------------------------------------------------------------


def test_300_ranks_under_ulimit_1024_all_get_their_reports(tmp_path):
    from tests.support import capture

    work = str(tmp_path)
    nfs, out = os.path.join(work, "nfs"), os.path.join(work, "out")
    os.makedirs(nfs)
    ranks = 300
    server = Server(work, out=out, nfs_path=nfs, args=["--exit-when-done", "--world-size", str(ranks)]).start()
    subprocess.run(["prlimit", "--nofile=1024:1024", "--pid", str(server.proc.pid)], check=True)
    a, b = torch.randn(4), torch.randn(4)
    with capture(backward=False) as (mode, sink):
        with mode:
            for _ in range(ranks):   # one record per rank: a record is encoded once, for the rank that sends it
                torch.add(a, b)
    try:
        for rank, rec in enumerate(sink):
            rec.seq = 0
            _send_one(nfs, "many", rank, ranks, rec)
        code = server.proc.wait(timeout=90)     # --exit-when-done: once all 300 end markers are read
    finally:
        server.stop()
    assert code == 0, server.log()[-3000:]
    missing = [r for r in range(ranks) if len(read_csv(out, "accuracy_checking_result", r)) != 1]
    assert not missing, f"ranks without their result row: {missing[:10]}... ({len(missing)})"
    summary = summary_of(out)
    assert summary["report_write_failures"]["records"] == 0
    assert sum(summary["calls_checked"].values()) == ranks


# -- a full disk -------------------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs_20m(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}): the disk-full test needs root or CAP_SYS_ADMIN")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): the disk-full test needs root or "
                    "CAP_SYS_ADMIN")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_disk_pauses_instead_of_skipping_and_leaves_nothing_half_written(tmp_path, tmpfs_20m):
    from tests.test_durability import TRAIN, check_exactly_once, counts_of

    work = str(tmp_path)
    out = os.path.join(tmpfs_20m, "out")
    filler = os.path.join(tmpfs_20m, "filler")
    server = Server(work, out=out).start()
    with open(filler, "wb") as fh:                    # leave about 64 KiB: the run needs more than that
        free = os.statvfs(tmpfs_20m).f_bavail * os.statvfs(tmpfs_20m).f_frsize
        fh.write(b"\0" * max(0, free - (64 << 10)))
    cfg = agent_config(os.path.join(work, "agent.json"), server.port, online_max_retry_s=0.3,
                       online_close_timeout_s=90)
    steps = 6
    t = Training(TRAIN, cfg, str(steps), "0.0", "1", "64", timeout=120)
    deadline = time.time() + 60
    while "disk full" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    assert "disk full" in server.log(), server.log()[-2000:]
    assert t.is_alive(), "the training finished although the server could not keep its records"
    time.sleep(1.0)
    os.unlink(filler)                                  # space again: the server goes on by itself
    proc = t.result(120)
    assert server.stop() == 0, server.log()[-3000:]
    counts = counts_of(proc)
    assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, counts
    per_step = check_exactly_once(out, 0, steps)
    for kind in report_files.KINDS:
        for r in read_csv(out, kind):
            assert "No space left" not in json.dumps(r, ensure_ascii=False), r
    for path in glob.glob(os.path.join(out, "*.csv")):
        with open(path, "rb") as fh:
            assert fh.read().endswith(b"\r\n"), f"{path} ends in a half-written row"
    assert not [p for p in glob.glob(os.path.join(out, "**", "*.tmp"), recursive=True)], "temporary files left"
    assert sum(map(len, per_step.values())) > 0


# -- evidence ----------------------------------------------------------------------------------------------------


def _send_failing_gelu(nfs: str, run_id: str) -> None:
    """One rank-0 run through the real folder transport whose gelu output is 5 % off (a faulty device)."""
    import torch.nn.functional as F

    from tests.support import capture

    x = torch.randn(8, 16)
    with capture(backward=False) as (mode, sink):
        with mode:
            F.gelu(x)
    rec = sink.forward("Functional.gelu.0")
    rec.output.tree = rec.output.tree * 1.05
    rec.seq = 0
    _send_one(nfs, run_id, 0, 1, rec)


@pytest.mark.parametrize("cap_mb", [None, 0], ids=["no-cap", "cap-0"])
def test_each_run_keeps_its_own_evidence_and_the_cap_holds(tmp_path, cap_mb):
    work = str(tmp_path)
    nfs, out = os.path.join(work, "nfs"), os.path.join(work, "out")
    os.makedirs(nfs)
    args = ["--error-data-max-mb", str(cap_mb)] if cap_mb is not None else []
    server = Server(work, out=out, nfs_path=nfs, args=args).start()
    _send_failing_gelu(nfs, "runA")
    deadline = time.time() + 60
    while len(read_csv(out, "accuracy_checking_result")) < 1 and time.time() < deadline:
        time.sleep(0.1)
    _send_failing_gelu(nfs, "runB")                    # a second training run into the same session
    while len(read_csv(out, "accuracy_checking_result")) < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert server.stop() == 0
    rows = read_csv(out, "accuracy_checking_result")
    assert [r["Forward Test Success"] for r in rows] == ["error", "error"], rows
    folders = sorted(glob.glob(os.path.join(out, "error_data", "*", "*", "rank0", "Functional.gelu.0.step0")))
    durability = summary_of(out)["durability"]
    if cap_mb is None:
        assert [f.split(os.sep)[-3] for f in folders] == ["runA", "runB"], folders
        assert durability["error_data_saved"] == 2
    else:
        assert folders == [] and durability["error_data_not_saved"] == 2, (folders, durability)
        assert "--error-data-max-mb" in server.log()


def test_out_that_cannot_be_created_gives_a_clear_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = tmp_path / "server.json"
    from tests.support import free_port, server_config

    server_config(str(cfg), port=free_port())
    gpu_server = os.path.join(os.path.dirname(PY), "gpu-server")
    proc = subprocess.run([gpu_server, "--config", str(cfg), "--out", str(blocker / "out")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--out" in proc.stderr and "cannot create" in proc.stderr, proc.stderr


def test_report_rows_that_cannot_be_written_are_counted_and_fail_the_exit_status(tmp_path):
    work = str(tmp_path)
    nfs, out = os.path.join(work, "nfs"), os.path.join(work, "out")
    os.makedirs(nfs)
    os.makedirs(os.path.join(out, "spool"))
    ts = "20260101000000"
    with open(os.path.join(out, "spool", "state.json"), "w") as fh:     # a session whose {ts} is known
        json.dump({"ts": ts, "starts": 1, "format": 1}, fh)
    os.makedirs(report_files.path(out, report_files.RESULT, ts, 0))    # the result file cannot be opened
    server = Server(work, out=out, nfs_path=nfs).start()
    _send_failing_gelu(nfs, "runA")
    deadline = time.time() + 60
    while "could not be written" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    assert server.stop() == 3, server.log()[-3000:]
    summary = summary_of(out)
    assert summary["report_write_failures"]["records"] == 1, summary["report_write_failures"]
    assert "REPORT ROWS NOT WRITTEN" in server.log()
    assert glob.glob(os.path.join(out, "spool", "seg-*.spl")), "the record must stay in the spool for a restart"
