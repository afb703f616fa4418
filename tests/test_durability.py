"""Nothing lost, nothing twice (docs/design.md §5 delivery, §6.3): the durable spool and a server killed with -9.

The end-to-end tests use a real gpu-server subprocess, real gRPC and a real training subprocess; the spool tests
drive gpu_server.spool.store directly on a real folder.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import time

import pytest

from tests.support import Server, Training, agent_config, read_csv

# argv: config, steps, pause per step (s), grad (0/1), width[, gate]. Prints "COUNTS {json}" (the agent's close()).
# With a gate (a file path) the training creates `{gate}.waiting` before step steps // 2 and waits there until the
# test creates the gate (at most 120 s): a test that kills a server mid-run knows the training is still running.
# Under torch.distributed (MASTER_ADDR set) each step also all-reduces the loss (a Distributed SKIP row).
TRAIN = r'''
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
cfg, steps, pause, grad, width = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
gate = sys.argv[6] if len(sys.argv) > 6 else ""
dist = None
if os.environ.get("MASTER_ADDR"):
    import torch.distributed as dist
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8))
dbg = PrecisionDebugger(config_path=cfg)
t0 = time.time()
for step in range(steps):
    if gate and step == steps // 2:
        open(gate + ".waiting", "w").close()
        deadline = time.time() + 120
        while not os.path.exists(gate) and time.time() < deadline:
            time.sleep(0.02)
    x, y = torch.randn(16, width), torch.randint(0, 8, (16,))
    dbg.start()
    with torch.set_grad_enabled(grad):
        loss = F.cross_entropy(model(x), y)
        if grad:
            loss.backward()
        if dist is not None:
            dist.all_reduce(loss.detach())
    dbg.stop()
    model.zero_grad()
    dbg.step()
    time.sleep(pause)
loop = time.time() - t0
counts = dbg.close() or {}
print("COUNTS " + json.dumps(dict(counts, loop_s=loop)))
if dist is not None:
    dist.destroy_process_group()
'''


def counts_of(proc) -> dict:
    line = [x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")][-1]
    return json.loads(line[len("COUNTS "):])


def summary_of(out: str) -> dict:
    paths = sorted(glob.glob(os.path.join(out, "summary_*.json")))
    with open(paths[-1], encoding="utf-8") as fh:
        return json.load(fh)


def check_exactly_once(out: str, rank: int, steps: int | None = None) -> dict[int, list[str]]:
    """Every (call, step) has exactly one row in both result files, every compared output exactly one row in both
    details files, and every step has the same calls (the model is the same each step). Returns names per step."""
    per_step: dict[int, list[str]] = collections.defaultdict(list)
    for kind, key in (("accuracy_checking_result", "API name"), ("api_precision_compare_result", "API Name"),
                      ("accuracy_checking_details", "API Name"), ("api_precision_compare_details", "API Name")):
        rows = read_csv(out, kind, rank)
        seen = collections.Counter((r[key], r["Step"]) for r in rows)
        twice = {k: n for k, n in seen.items() if n > 1}
        assert not twice, f"rank {rank}: rows written more than once in {kind}: {twice}"
        if kind == "accuracy_checking_result":
            for r in rows:
                per_step[int(r["Step"])].append(r[key])
    assert per_step, f"rank {rank}: no result rows in {out}"
    first = sorted(per_step[min(per_step)])
    for step, names in per_step.items():
        assert sorted(names) == first, f"rank {rank} step {step}: {sorted(names)} != step 0's {first}"
    if steps is not None:
        assert sorted(per_step) == list(range(steps)), f"rank {rank}: steps {sorted(per_step)}"
    return per_step


def _rows(out: str, rank: int = 0) -> int:
    return len(read_csv(out, "accuracy_checking_result", rank))


def test_kill_9_mid_run_then_restart_reports_every_record_once(tmp_path):
    work = str(tmp_path)
    out = os.path.join(work, "out")
    steps = 24
    gate = os.path.join(work, "gate")     # the training waits before step 12 until the second server is up
    first = Server(work, out=out).start()
    cfg = agent_config(os.path.join(work, "agent.json"), first.port, online_max_retry_s=0.3,
                       online_close_timeout_s=90)
    t = Training(TRAIN, cfg, str(steps), "0.04", "1", "96", gate, timeout=150)
    deadline = time.time() + 60
    while _rows(out) < 12 and time.time() < deadline and t.is_alive():
        time.sleep(0.02)
    killed_at = _rows(out)
    first.kill()            # SIGKILL: no drain, no flush, no summary
    assert t.is_alive(), f"the training ended before the kill: {t.error}"
    assert killed_at >= 12, f"only {killed_at} result rows within 60 s"
    time.sleep(1.0)         # the agent notices, keeps its unacknowledged records and retries
    second = Server(work, port=first.port, out=out).start()
    open(gate, "w").close()  # steps 12-23 go to the restarted server
    counts = counts_of(t.result(150))
    assert second.stop() == 0
    log = second.log()
    assert "resuming the session" in log

    per_step = check_exactly_once(out, 0, steps)
    calls = sum(len(v) for v in per_step.values())
    summary = summary_of(out)
    assert counts["captured"] == counts["acknowledged"] + counts["rejected"], counts
    assert counts["dropped"] == 0 and counts["unacknowledged"] == 0, counts
    # Forward and backward records: every call has its forward row; calls with a backward have a backward row.
    details = read_csv(out, "accuracy_checking_details")
    backward_calls = {(r["API Name"].split(".backward.")[0], r["Step"]) for r in details
                      if ".backward." in r["API Name"]}
    assert calls + len(backward_calls) == counts["captured"], (calls, len(backward_calls), counts)
    assert summary["session"]["resumed"] and summary["session"]["server_starts"] == 2
    assert len(glob.glob(os.path.join(out, "accuracy_checking_result_*_rank0.csv"))) == 1  # one set of files
    assert not glob.glob(os.path.join(out, "spool", "seg-*.spl")), "spool entries left after the drain"
    print(f"\nkill -9 after {killed_at} result rows: captured {counts['captured']}, acknowledged "
          f"{counts['acknowledged']}, duplicates {counts['duplicates']}, reported calls {calls} "
          f"(+{len(backward_calls)} backward), spool at restart {summary['session']['spool_records_at_start']}, "
          f"bytes cut {summary['session']['unjournaled_bytes_cut']}")


def test_second_server_on_the_same_out_is_refused(tmp_path):
    work = str(tmp_path)
    out = os.path.join(work, "out")
    with Server(work, out=out):
        other = Server(work, out=out)
        with pytest.raises(RuntimeError, match="in use by another gpu-server"):
            other.start()
        other._log.close()


# -- the spool on its own ---------------------------------------------------------------------------------------


def _record(seq: int, payload: bytes, run: str = "run1", rank: int = 0):
    from protos import online_check_pb2 as pb

    rec = pb.Record(header=pb.RecordHeader(run_id=run, rank=rank, step=0, seq=seq, name=f"Torch.abs.{seq}",
                                           direction=pb.FORWARD), payload_bytes=len(payload))
    return rec, bytearray(payload)


def test_spool_keeps_until_complete_and_resumes(tmp_path):
    from gpu_server.spool.store import Spool
    from protos import online_check_pb2 as pb

    out = str(tmp_path)
    report = os.path.join(out, "accuracy_checking_result_20260101000000_rank0.csv")
    sp = Spool(out)
    rec = sp.open("20260101000000")
    assert not rec.resumed and rec.ts == "20260101000000"
    tickets = [sp.append(*_record(i, bytes([i]) * (100 + i))) for i in range(5)]
    assert [t.wait(10) for t in tickets] == [(pb.Ack.ACCEPTED, "")] * 5
    with open(report, "w") as fh:
        fh.write("header\nrow0\nrow1\n")
    sp.complete([("run1", 0, 0), ("run1", 0, 1)], [("run1", 0, 2)], {report: os.path.getsize(report)})
    sp.flush()
    with open(report, "a") as fh:
        fh.write("row3-not-journaled\npartial")
    sp.close()

    sp = Spool(out)
    rec = sp.open("20990101000000")
    assert rec.resumed and rec.ts == "20260101000000" and rec.starts == 2
    assert [e.key[2] for e in rec.replay] == [2, 3, 4] and rec.half == {("run1", 0, 2)}
    assert set(sp.seen()) == {("run1", 0, i) for i in range(5)}
    with open(report) as fh:
        assert fh.read() == "header\nrow0\nrow1\n"     # the unjournaled rows were cut off
    record, payload = sp.read(rec.replay[1])
    assert record.header.seq == 3 and payload == bytearray(bytes([3]) * 103)
    sp.complete([("run1", 0, 2), ("run1", 0, 3), ("run1", 0, 4)], [], {})
    sp.close()
    assert not glob.glob(os.path.join(out, "spool", "seg-*.spl"))
    sp = Spool(out)
    assert sp.open("x").replay == []
    sp.close()


def test_spool_survives_a_torn_journal_line_and_rejects_a_damaged_segment(tmp_path):
    from gpu_server.spool.store import Spool

    out = str(tmp_path)
    sp = Spool(out)
    sp.open("20260101000000")
    for i in range(3):
        sp.append(*_record(i, b"x" * 64)).wait(10)
    sp.complete([("run1", 0, 0)], [], {})
    sp.close()
    with open(os.path.join(out, "spool", "journal.log"), "a") as fh:
        fh.write('{"d": [["run1", 0, 1]')                       # killed while writing a line
    seg = sorted(glob.glob(os.path.join(out, "spool", "seg-*.spl")))[-1]
    with open(seg, "r+b") as fh:                               # flip a payload byte of the last record
        fh.seek(-1, os.SEEK_END)
        fh.write(b"y")
    sp = Spool(out)
    rec = sp.open("20260101000000")
    assert [e.key[2] for e in rec.replay] == [1, 2]
    with pytest.raises(ValueError, match="checksum"):
        sp.read(rec.replay[-1])
    sp.close()


# -- restart, then re-send (issue 24) ---------------------------------------------------------------------------


def _relu_frames(seq: int, run: str = "resend", rank: int = 0) -> list[bytes]:
    """A real encoded Functional.relu record (seq `seq`) as the agent sends it: its wire frames."""
    import torch

    from npu_agent.records import PendingRecord, encode_record
    from npu_agent.snapshot import snapshot

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seq))
    rec = PendingRecord(name=f"Functional.relu.{seq}", step=0, seq=seq, inputs=snapshot(((x,), {})),
                        output=snapshot(torch.relu(x)))
    enc = encode_record(rec, run, rank)
    return list(enc.wire_frames(1 << 20))


def _send(port: int, seqs) -> dict[int, int]:
    """Send the relu records `seqs` on one stream; their acknowledgements' statuses by seq."""
    from tests.support import stream_acks

    msgs = [f for seq in seqs for f in _relu_frames(seq)]
    acks = stream_acks(port, msgs, lambda acks: len(acks) >= len(seqs), timeout=60)
    return {a.seq: a.status for a in acks}


def test_records_re_sent_after_a_restart_are_duplicates_and_reported_once(tmp_path):
    """A server accepts records and is killed with -9 (some are reported, some only spooled: either way accepted);
    a second server on the same --out gets the same (run, rank, seq) records again, as an agent re-sends what it
    is unsure of: every one is answered DUPLICATE, never checked again, and each has exactly one row."""
    from protos import online_check_pb2 as pb

    work = str(tmp_path)
    out = os.path.join(work, "out")
    first = Server(work, out=out).start()
    assert _send(first.port, range(6)) == {seq: pb.Ack.ACCEPTED for seq in range(6)}
    deadline = time.time() + 20               # a few reported (journaled), the rest possibly only in the spool
    while _rows(out) < 2 and time.time() < deadline:
        time.sleep(0.01)
    first.kill()
    second = Server(work, out=out).start()
    acks = _send(second.port, range(8))       # 0-5 again, 6 and 7 new
    assert acks == {**{seq: pb.Ack.DUPLICATE for seq in range(6)}, 6: pb.Ack.ACCEPTED, 7: pb.Ack.ACCEPTED}, acks
    assert second.stop() == 0, second.log()[-3000:]
    assert "resuming the session" in second.log()
    for kind, key in (("accuracy_checking_result", "API name"), ("api_precision_compare_result", "API Name"),
                      ("accuracy_checking_details", "API Name")):
        names = collections.Counter(r[key].split(".forward")[0] for r in read_csv(out, kind))
        assert names == {f"Functional.relu.{seq}": 1 for seq in range(8)}, (kind, names)
    result = read_csv(out, "accuracy_checking_result")
    assert all(r["Forward Test Success"] == "pass" for r in result), result
    summary = summary_of(out)
    assert summary["session"]["resumed"] and summary["session"]["server_starts"] == 2


# -- the fsync order of the spool (issue 24) --------------------------------------------------------------------


class _Trace:
    """os.fsync and os.unlink recorded in order, with the file each acted on, and every acknowledgement set."""

    def __init__(self, monkeypatch):
        import threading

        from gpu_server.spool import acks as spool_acks

        self.events: list[tuple[str, str]] = []
        self.journal_at_fsync: list[str] = []     # the journal's text whenever a report file is fsync'ed
        self.journal_path = ""
        self._lock = threading.Lock()
        real_fsync, real_unlink, real_set = os.fsync, os.unlink, spool_acks.Ticket.set

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            real_fsync(fd)
            with self._lock:
                self.events.append(("fsync", path))
                if path.endswith(".csv") and self.journal_path:
                    with open(self.journal_path, encoding="utf-8") as fh:
                        self.journal_at_fsync.append(fh.read())

        def unlink(path, *args, **kwargs):
            real_unlink(path, *args, **kwargs)
            with self._lock:
                self.events.append(("unlink", os.fspath(path)))

        def ticket_set(ticket, status, reason=""):
            with self._lock:
                self.events.append(("ack", str(ticket.seq)))
            real_set(ticket, status, reason)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(spool_acks.Ticket, "set", ticket_set)

    def index(self, kind: str, test) -> list[int]:
        return [i for i, (k, what) in enumerate(self.events) if k == kind and test(what)]


def test_spool_fsyncs_a_segment_before_its_ack_and_the_journal_before_rows_count_as_durable(tmp_path, monkeypatch):
    """The order gpu_server/spool/acks.py and spool_journal.py promise (and a server without fsync breaks):
    1. acceptance: a record's segment is written to seg-N.spl.tmp and fsync'ed, renamed, the spool folder fsync'ed,
       and only then is its ticket set ACCEPTED (the acknowledgement the agent waits for);
    2. completion: the report files named in `complete` are fsync'ed first, then the journal line saying their rows
       are complete is written and fsync'ed, and only then is the record's segment deleted (the rows, not the
       spool, are from then on what holds the record)."""
    from gpu_server.spool.store import Spool
    from protos import online_check_pb2 as pb

    out = str(tmp_path)
    spool_dir = os.path.join(out, "spool")
    trace = _Trace(monkeypatch)
    sp = Spool(out)
    sp.open("20260101000000")
    trace.journal_path = os.path.join(spool_dir, "journal.log")
    for seq in range(3):                          # one record per group commit: one segment each
        assert sp.append(*_record(seq, bytes([seq]) * 64)).wait(10) == (pb.Ack.ACCEPTED, "")
    segs = sorted(glob.glob(os.path.join(spool_dir, "seg-*.spl")))
    assert len(segs) == 3, segs
    for seq, seg in enumerate(segs):
        ack = trace.index("ack", lambda s, seq=seq: s == str(seq))
        seg_fsync = trace.index("fsync", lambda p, seg=seg: p == seg + ".tmp")
        dir_fsync = trace.index("fsync", lambda p: p == spool_dir)
        assert len(ack) == 1 and seg_fsync, (seq, trace.events)
        assert seg_fsync[0] < ack[0], f"record {seq} acknowledged before its segment was fsync'ed: {trace.events}"
        assert any(seg_fsync[0] < d < ack[0] for d in dir_fsync), \
            f"record {seq}: the spool folder (the rename) not fsync'ed before the ack: {trace.events}"

    report = os.path.join(out, "accuracy_checking_result_20260101000000_rank0.csv")
    with open(report, "w") as fh:
        fh.write("header\nrow0\nrow1\n")
    sp.complete([("run1", 0, 0), ("run1", 0, 1)], [], {report: os.path.getsize(report)})
    sp.flush()
    report_fsync = trace.index("fsync", lambda p: p == report)
    journal_fsync = trace.index("fsync", lambda p: p == trace.journal_path)
    gone = [trace.index("unlink", lambda p, seg=seg: p == seg) for seg in segs[:2]]
    assert report_fsync and journal_fsync and all(gone), trace.events
    assert report_fsync[0] < journal_fsync[0], f"the journal fsync'ed before the rows it covers: {trace.events}"
    assert all(journal_fsync[0] < g[0] for g in gone), f"a segment deleted before the journal was fsync'ed: " \
        f"{trace.events}"
    assert '"d":[["run1",0,0],["run1",0,1]]' not in trace.journal_at_fsync[0], \
        "the journal line was written before the report file was fsync'ed"
    assert not trace.index("unlink", lambda p: p == segs[2]), "record 2 is not reported: its segment must stay"
    with open(trace.journal_path, encoding="utf-8") as fh:
        assert '"d":[["run1",0,0],["run1",0,1]]' in fh.read()
    sp.close()
