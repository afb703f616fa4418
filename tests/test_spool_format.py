"""The spool's on-disk format, pinned byte for byte (a server must read what an earlier version spooled), and the
small parts of the lifecycle on their own: the journal, the sequence sets, `PendingCalls`."""
from __future__ import annotations

import json
import os

import pytest

from gpu_server.checking.checker import Forward
from gpu_server.checking.pending import PendingCalls
from gpu_server.job import RecordKey
from gpu_server.seqset import SeqSet
from gpu_server.spool import direct_io
from gpu_server.spool.journal import JournalState, read_journal
from gpu_server.spool.segments import read_entry, scan_segment, write_segment
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS

# magic | "REC1" | header length 31 (u32) | payload length 4 (u64) | crc32(header) | crc32(payload) | header | payload
SEGMENT_HEX = ("4f4353504f4f4c31" "52454331" "1f000000" "0400000000000000" "d13e276c" "cdfb3cb6"
               "0a1b0a0472756e3110031807202a2a0b546f7263682e6164642e30300118" "04" "01020304")


def _record() -> pb.Record:
    return pb.Record(header=pb.RecordHeader(run_id="run1", rank=3, step=7, seq=42, name="Torch.add.0",
                                            direction=pb.FORWARD), payload_bytes=4)


def test_segment_bytes_are_pinned(tmp_path):
    path = str(tmp_path / "seg-000000000.spl")
    write_segment(path, [(_record().SerializeToString(), b"\x01\x02\x03\x04")], fsync=False)
    with open(path, "rb") as fh:
        assert fh.read().hex() == SEGMENT_HEX
    assert os.listdir(tmp_path) == ["seg-000000000.spl"]          # no temporary file left


@pytest.mark.parametrize("fsync", [True, False])
def test_a_durable_segment_written_through_the_page_cache_leaves_it(tmp_path, monkeypatch, fsync):
    """Where O_DIRECT is refused (tests/test_spool_direct.py has the other way), a segment once fsync'ed has its pages
    dropped from the page cache (posix_fadvise DONTNEED), not before; without fsync (dirty pages) nothing is
    dropped. Same bytes either way."""
    if not hasattr(os, "POSIX_FADV_DONTNEED"):
        pytest.skip("no posix_fadvise here")
    monkeypatch.setattr(direct_io, "O_DIRECT", 0)   # as on a system without it
    events: list[tuple] = []
    real_fsync, real_fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", fd)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, advice: (events.append(("fadvise", fd, off, n, advice)),
                                                    real_fadvise(fd, off, n, advice))[1])
    path = str(tmp_path / "seg-000000000.spl")
    write_segment(path, [(_record().SerializeToString(), b"\x01\x02\x03\x04")], fsync=fsync)
    if fsync:
        fd = events[0][1]
        assert events == [("fsync", fd), ("fadvise", fd, 0, 0, os.POSIX_FADV_DONTNEED)]
    else:
        assert events == []
    with open(path, "rb") as fh:
        assert fh.read().hex() == SEGMENT_HEX


def test_a_file_system_that_refuses_the_advice_loses_nothing(tmp_path, monkeypatch):
    """posix_fadvise is advice: where it fails, the segment is still written, renamed into place and readable."""
    def refuse(fd, off, n, advice):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(direct_io, "O_DIRECT", 0)   # through the page cache
    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    path = str(tmp_path / "seg-000000000.spl")
    write_segment(path, [(_record().SerializeToString(), b"\x01\x02\x03\x04")], fsync=True)
    with open(path, "rb") as fh:
        assert fh.read().hex() == SEGMENT_HEX
    assert os.listdir(tmp_path) == ["seg-000000000.spl"]


def test_pinned_segment_reads_back(tmp_path):
    path = tmp_path / "seg-000000005.spl"
    path.write_bytes(bytes.fromhex(SEGMENT_HEX))
    entries, damage = scan_segment(5, str(path), DEFAULT_LIMITS)
    assert damage == [] and len(entries) == 1
    e = entries[0]
    assert (e.key, e.name, e.step, e.direction, e.offset, e.header_len, e.payload_len) == (
        ("run1", 3, 42), "Torch.add.0", 7, pb.FORWARD, 32, 31, 4)
    record, payload = read_entry(str(tmp_path), e)
    assert record == _record() and payload == bytearray(b"\x01\x02\x03\x04")


def test_scan_resynchronises_after_damage(tmp_path):
    one = bytes.fromhex(SEGMENT_HEX)
    entry = one[8:]
    path = tmp_path / "seg-000000001.spl"
    path.write_bytes(one + b"REC1junkjunk" + entry + entry[:20])   # garbage, a good entry, a cut-off one
    entries, damage = scan_segment(1, str(path), DEFAULT_LIMITS)
    assert len(entries) == 2
    assert [d.skipped for d in damage] == [12, 20]


def test_journal_snapshot_line_is_pinned_and_damage_is_detected(tmp_path):
    state = JournalState()
    for s in (0, 1, 2, 5):
        state.mark_done(("run1", 0, s))
    state.half.add(("run1", 0, 6))
    state.files["accuracy_checking_result_20260101000000_rank0.csv"] = 120
    assert json.dumps({"snapshot": state.snapshot()}, separators=(",", ":")) == (
        '{"snapshot":{"done":{"run1":{"0":[[0,2],[5,5]]}},"half":[["run1",0,6]],'
        '"files":{"accuracy_checking_result_20260101000000_rank0.csv":120},"ends":[]}}')
    path = tmp_path / "journal.log"
    line = json.dumps({"snapshot": state.snapshot()}) + "\n" + '{"d":[["run1",0,6]],"h":[],"f":{}}\n'
    path.write_text(line + '{"d":[["run1",0,')                       # a torn last line is normal
    back = read_journal(str(path))
    assert not back.damaged and back.is_done(("run1", 0, 6)) and not back.half
    path.write_text(line[:20])                                       # `truncate -s 20`
    assert read_journal(str(path)).damaged
    path.write_text('{"d":[["run1",0,6]],"h":[],"f":{}}\n')        # no snapshot first
    assert read_journal(str(path)).damaged


def test_a_quarantine_line_is_pinned_kept_in_the_snapshot_until_done(tmp_path):
    """`q`: a record whose replay killed its worker process (gpu_server/replay/sandbox.py) is never replayed at
    restart."""
    path = tmp_path / "journal.log"
    state = JournalState()
    path.write_text(json.dumps({"snapshot": state.snapshot()}) + "\n"
                    + '{"q":[["run1",0,7,"signal SIGSEGV"]]}\n')
    back = read_journal(str(path))
    assert back.quarantined == {("run1", 0, 7): "signal SIGSEGV"}
    assert json.dumps(back.snapshot()["quarantined"]) == '[["run1", 0, 7, "signal SIGSEGV"]]'
    path.write_text(json.dumps({"snapshot": back.snapshot()}) + "\n" + '{"d":[["run1",0,7]],"h":[],"f":{}}\n')
    done = read_journal(str(path))
    assert not done.quarantined and "quarantined" not in done.snapshot() and done.is_done(("run1", 0, 7))


def test_seqset_stays_small_for_ordered_streams():
    s = SeqSet()
    for i in range(100_000):
        assert s.add(i)
    assert s.ranges() == [[0, 99_999]] and len(s) == 100_000 and not s.add(500)
    s.add(100_001)
    assert s.ranges() == [[0, 99_999], [100_001, 100_001]]
    s.add(100_000)                                          # fills the gap: the two ranges merge
    assert s.ranges() == [[0, 100_001]]
    assert 100_002 not in s and 7 in s


class _Job:
    def __init__(self, seq, name, nbytes=10, step=0):
        self.run_id, self.rank, self.seq, self.step, self.name, self.nbytes = "r", 0, seq, step, name, nbytes
        self.direction, self.backward_expected = pb.FORWARD, True


class _Checker:
    """Computes nothing: a forward's outcome is its name, its rows an empty list."""

    @staticmethod
    def forward(job, keep):
        return Forward(outcome=f"{job.name} outcome", checked=[], graphs=None)


def test_pending_calls_decide_what_is_journaled():
    p = PendingCalls(backward_budget=25, restored={("r", 0, 9)})
    checker, written = _Checker(), []
    done = p.check(_Job(1, "Torch.a.0"), checker, written.append)
    assert done.half == [RecordKey("r", 0, 1)] and done.done == [] and written == [[]]   # its detail rows
    p.check(_Job(2, "Torch.b.0"), checker, written.append)
    p.check(_Job(3, "Torch.c.0"), checker, written.append)  # 30 bytes > 25: the oldest forward job is evicted
    assert p.evictions == 1 and p.held == 20
    restored = _Job(9, "Torch.d.0")
    assert p.is_restored(restored)
    assert p.check(restored, checker, written.append).half == []   # journaled `h` before the restart: nothing new
    assert len(written) == 3 and not p.is_restored(restored)         # nor written again
    waiting = p.take(_Job(20, "Torch.a.0"))
    assert waiting.evicted and waiting.outcome == "Torch.a.0 outcome"
    assert p.backward_done(_Job(20, "Torch.a.0"), waiting).done == [RecordKey("r", 0, 20), RecordKey("r", 0, 1)]
    assert p.stop() == 3 and p.waiting_count() == 3         # a stop reports and journals nothing
    ended = p.rank_ended("r", 0)
    assert sorted(w.record.seq for _k, w in ended) == [2, 3, 9] and p.waiting_count() == 0 and p.held == 0


@pytest.mark.parametrize("name", ["accuracy_checking_result_20260101000000_rank12.csv"])
def test_report_file_names_have_one_home(name):
    from gpu_server.reports import files as report_files

    assert report_files.parse(name) == ("accuracy_checking_result", "20260101000000", 12)
    assert report_files.name(*report_files.parse(name)) == name
    assert report_files.parse("accuracy_checking_result_2026_rank1.csv") is None


def test_report_files_share_a_bounded_set_of_open_files(tmp_path):
    import gpu_server.reports.rank_reports as reports
    from gpu_server.reports import files as report_files

    files = reports.OpenFiles(limit=3)
    saved, reports.OPEN_FILES = reports.OPEN_FILES, files
    try:
        ranks = [reports.RankReports(str(tmp_path), "20260101000000", r) for r in range(4)]
        for step in range(3):
            for rep in ranks:                          # interleaved: every write may reopen a closed file
                rep.write([reports.result_row("Torch.add.0", "pass", " ", "", step)])
                assert len(files._open) <= 3
        for rep in ranks:
            rep.close()
    finally:
        reports.OPEN_FILES = saved
    assert files.reopened > 4
    for r in range(4):
        with open(report_files.path(str(tmp_path), report_files.RESULT, "20260101000000", r), "rb") as fh:
            data = fh.read()
        assert data.count("\ufeff".encode()) == 1 and data.startswith("\ufeff".encode())
        lines = data.decode("utf-8-sig").splitlines()
        step = lines[0].split(",").index("Step")   # our columns come after msprobe's
        assert lines[0].startswith("API name,") and [ln.split(",")[step] for ln in lines[1:]] == ["0", "1", "2"]


def test_long_sessions_compact_the_journal_and_resume_from_it(tmp_path, monkeypatch):
    import gpu_server.spool.journal as spool_journal
    from gpu_server.spool.store import Spool

    monkeypatch.setattr(spool_journal, "COMPACT_BYTES", 2000)
    out = str(tmp_path)
    report = os.path.join(out, "accuracy_checking_result_20260101000000_rank0.csv")
    sp = Spool(out, fsync=False)
    sp.open("20260101000000")
    for i in range(60):
        rec = pb.Record(header=pb.RecordHeader(run_id="run1", rank=0, step=0, seq=i, name=f"Torch.abs.{i}",
                                               direction=pb.FORWARD), payload_bytes=8)
        assert sp.append(rec, bytearray(8)).wait(10)[0] == pb.Ack.ACCEPTED
        with open(report, "a") as fh:
            fh.write(f"row{i}\n")
        done, half = ([("run1", 0, i)], []) if i != 7 else ([], [("run1", 0, 7)])
        sp.complete(done, half, {report: os.path.getsize(report)})
        sp.flush()
    assert sp.journal.compactions >= 1
    sp.close()
    with open(os.path.join(out, "spool", "journal.log")) as fh:
        lines = fh.read().splitlines()
    assert len(lines) < 30 and lines[0].startswith('{"snapshot"')
    sp = Spool(out, fsync=False)
    rec = sp.open("x")
    assert [e.key for e in rec.replay] == [("run1", 0, 7)] and rec.half == {("run1", 0, 7)}
    assert rec.done_count == 59 and not rec.truncated and not rec.journal_damaged
    sp.close()


def test_a_worker_adding_to_the_journal_never_waits_for_its_fsync(tmp_path, monkeypatch):
    """`Journal.add` runs on a worker thread after every record: while the journal thread is inside an fsync (which
    can take tens of ms on a real disk) it must not wait. Lines keep their order, `add_now`'s included."""
    import threading

    import gpu_server.spool.journal as spool_journal

    path = str(tmp_path / "journal.log")
    journaled: list = []
    journal = spool_journal.Journal(path, fsync=True, on_journaled=journaled.extend)
    journal.open(JournalState())
    inside, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:
        inside.set()
        release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(spool_journal.os, "fsync", held_fsync)
    journal.add({"d": [["r", 0, 1]], "h": [], "f": {}}, [("r", 0, 1)], [])
    assert inside.wait(10)                      # the journal thread now waits inside its fsync
    adder = threading.Thread(target=journal.add, args=({"d": [["r", 0, 2]], "h": [], "f": {}}, [("r", 0, 2)], []))
    adder.start()
    adder.join(5)
    assert not adder.is_alive() and not release.is_set()   # added while the fsync is still held
    release.set()
    journal.add_now({"q": [["r", 0, 3, "why"]]})
    journal.add({"d": [["r", 0, 4]], "h": [], "f": {}}, [("r", 0, 4)], [])
    journal.close()
    monkeypatch.undo()
    with open(path) as fh:
        lines = [json.loads(line) for line in fh.read().splitlines()[1:]]
    assert lines == [{"d": [["r", 0, 1]], "h": [], "f": {}}, {"d": [["r", 0, 2]], "h": [], "f": {}},
                     {"q": [["r", 0, 3, "why"]]}, {"d": [["r", 0, 4]], "h": [], "f": {}}]
    assert journaled == [("r", 0, 1), ("r", 0, 2), ("r", 0, 4)]
    state = read_journal(path)
    assert all(state.is_done(("r", 0, s)) for s in (1, 2, 4)) and ("r", 0, 3) in state.quarantined
