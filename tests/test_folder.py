"""The shared-folder transport (docs/design.md §5, shared folder): npu_agent/transport_folder.py -> a real folder ->
gpu_server/intake/folder.py -> the intake. In-process tests drive the real Sender, FolderTransport, FolderReader and
Intake
on a real folder; the end-to-end test runs a real training process and a real gpu-server process on it."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import time

import torch

from gpu_server.config import ServerConfig
from gpu_server.intake.admission import Intake
from gpu_server.intake.folder import FolderReader
from npu_agent.records import PendingRecord
from npu_agent.sender import Sender
from npu_agent.snapshot import snapshot
from npu_agent.transport_folder import FolderTransport
from protos import online_check_pb2 as pb
from protos.codec import FOLDER_MAGIC, folder_end_name, folder_record_name
from protos.limits import DEFAULT_LIMITS
from tests import support

RUN = "run0123456789abcd"


def make_record(i: int, numel: int = 16) -> PendingRecord:
    x = torch.arange(numel, dtype=torch.float32) - numel / 2
    return PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((x,), {})),
                         output=snapshot(torch.relu(x)))


class Collect:
    """A real Intake whose dispatch keeps the jobs (replay is not what these tests are about)."""

    def __init__(self, limits=DEFAULT_LIMITS):
        self.jobs = []
        self.ends = []
        self.intake = Intake(ServerConfig(), self.jobs.append, limits)

    def reader(self, nfs, **kw) -> FolderReader:
        return FolderReader(str(nfs), self.intake, self.intake.limits, self.ends.append, **kw)

    @property
    def seqs(self):
        return [(j.run_id, j.seq) for j in self.jobs]


def write_run(nfs, n: int, run_id: str = RUN, rank: int = 0, chunk_bytes: int = 1 << 20, big: int = 16) -> dict:
    """Send n records through the real Sender and FolderTransport, end of stream included; return the counts. Each
    record is written before the next is submitted, so each gets its own file (records that queue up share one:
    tests/test_batching.py)."""
    transport = FolderTransport(str(nfs), run_id, rank, 1, chunk_bytes=chunk_bytes)
    sender = Sender(transport, budget_bytes=64 << 20)
    for i in range(n):
        assert sender.submit(make_record(i, big if i == 1 else 16))
        deadline = time.monotonic() + 30
        while sender.counts.acknowledged <= i and time.monotonic() < deadline:
            time.sleep(0.001)
    return sender.close(timeout=30)


def listing(nfs, rank: int = 0) -> list[str]:
    return sorted(os.listdir(nfs / f"rank{rank}"))


def test_records_are_published_atomically_acknowledged_and_read_in_order(tmp_path):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    # record 1 is 64 KiB of payload in 4 KiB frames: a multi-frame file
    counts = write_run(nfs, 6, chunk_bytes=4096, big=16384)
    assert counts["acknowledged"] == 6 and counts["unacknowledged"] == 0 and counts["last_seq"] == 6
    names = listing(nfs)
    assert names == sorted([folder_record_name(RUN, 0, i) for i in range(6)] + [folder_end_name(RUN, 0)])
    assert all(not n.startswith(".") for n in names), "no temporary file is left behind"
    with open(nfs / "rank0" / folder_record_name(RUN, 0, 1), "rb") as fh:
        assert fh.read(len(FOLDER_MAGIC)) == FOLDER_MAGIC
    c = Collect()
    reader = c.reader(nfs)
    assert reader.poll_once()
    assert c.seqs == [(RUN, i) for i in range(6)]
    assert torch.equal(c.jobs[1].args[0], torch.arange(16384, dtype=torch.float32) - 8192)
    assert [e.last_seq for e in c.ends] == [6] and c.ends[0].acknowledged == 6
    assert listing(nfs) == [], "every file is deleted once the intake took it"
    assert not reader.poll_once() and len(c.jobs) == 6


def test_a_gap_is_waited_for_and_skipped_only_after_the_end_marker_settled(tmp_path, caplog):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    write_run(nfs, 5)
    hold = tmp_path / "held"
    shutil.move(nfs / "rank0" / folder_record_name(RUN, 0, 2), hold)
    end = nfs / "rank0" / folder_end_name(RUN, 0)
    shutil.move(end, tmp_path / "end")
    c = Collect()
    reader = c.reader(nfs, gap_grace_s=3600)
    reader.poll_once()
    assert c.seqs == [(RUN, 0), (RUN, 1)], "records after the gap wait"
    reader.poll_once()
    assert c.seqs == [(RUN, 0), (RUN, 1)]
    shutil.move(hold, nfs / "rank0" / folder_record_name(RUN, 0, 2))
    reader.poll_once()
    assert c.seqs == [(RUN, i) for i in range(5)] and c.ends == []

    # a record that never comes (the agent could not encode it): skipped once the end marker has settled
    write_run(nfs, 4, run_id="run2")
    os.unlink(nfs / "rank0" / folder_record_name("run2", 0, 1))
    shutil.move(tmp_path / "end", end)
    reader.gap_grace_s = 3600
    reader.poll_once()
    assert [s for r, s in c.seqs if r == "run2"] == [0] and len(c.ends) == 1, "only run 0 ended"
    reader.gap_grace_s = 0
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        reader.poll_once()
    assert [s for r, s in c.seqs if r == "run2"] == [0, 2, 3]
    assert sorted(e.run_id for e in c.ends) == sorted(["run2", RUN])
    assert "records 1..1 never arrived" in caplog.text
    assert listing(nfs) == []


def _frame_file(frames: list[bytes], magic: bytes = FOLDER_MAGIC) -> bytes:
    return magic + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def test_garbage_is_moved_aside_once_and_temporary_files_are_never_read(tmp_path, caplog):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    write_run(nfs, 3)
    rank0 = nfs / "rank0"
    good = (rank0 / folder_record_name(RUN, 0, 0)).read_bytes()
    os.unlink(rank0 / folder_record_name(RUN, 0, 0))
    os.unlink(rank0 / folder_end_name(RUN, 0))
    record_frame = pb.Frame.FromString(good[len(FOLDER_MAGIC) + 4:])
    huge = pb.Frame()
    huge.CopyFrom(record_frame)
    huge.record.header.seq = 7
    huge.record.payload_bytes = 1 << 40

    def with_seq(seq: int) -> bytes:
        f = pb.Frame()
        f.CopyFrom(record_frame)
        f.record.header.seq = seq
        return f.SerializeToString()

    liar = pb.Frame()
    liar.CopyFrom(record_frame)
    liar.record.header.seq = 0  # the file is named seq 8: the content does not match the name
    bad = {
        "notes.txt": b"hello",
        folder_record_name(RUN, 0, 3): b"\x00" * 100,                                      # no magic
        folder_record_name(RUN, 0, 4): good[:-5],                                            # truncated
        folder_record_name(RUN, 0, 5): FOLDER_MAGIC + struct.pack("<I", 0xFFFFFFF0) + b"x",  # huge frame length
        folder_record_name(RUN, 0, 6): _frame_file([b"\xff\xff\xff"]),                       # not a Frame
        folder_record_name(RUN, 0, 7): _frame_file([huge.SerializeToString()]),              # huge payload
        folder_record_name(RUN, 0, 8): _frame_file([liar.SerializeToString()]),              # name/content mismatch
        folder_record_name(RUN, 0, 9): _frame_file([with_seq(9)] * 2),                       # two records
        "other.rank1.000000000010.rec": good,                                                # rank of another folder
    }
    for name, data in bad.items():
        (rank0 / name).write_bytes(data)
    partial = rank0 / f".{folder_record_name(RUN, 0, 10)}.123.tmp"
    partial.write_bytes(good[:20])
    os.symlink("/etc/hostname", rank0 / folder_record_name("link", 0, 0))
    (rank0 / folder_record_name(RUN, 0, 10)).write_bytes(_frame_file([with_seq(10)]))
    c = Collect()
    reader = c.reader(nfs)
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        reader.poll_once()
        reader.poll_once()
    assert c.seqs == [(RUN, 1), (RUN, 2), (RUN, 10)], "good records around the garbage are all processed"
    rejected = sorted(os.listdir(nfs / "rejected"))
    expected = sorted([f"rank0_{n}" for n in bad] + [f"rank0_{folder_record_name('link', 0, 0)}"])
    assert rejected == expected
    assert os.listdir(rank0) == [partial.name], "the temporary file is left alone"
    warnings = [r.getMessage() for r in caplog.records if "is not a valid record file" in r.getMessage()]
    assert len(warnings) == len(expected), warnings
    for why in ("folder magic", "runs past the end", "exceeds the limit", "not a valid Frame", "above the limit",
                "not what its name says", "more frames follow", "symbolic link", "the name is not"):
        assert any(why in w for w in warnings), why
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        reader.poll_once()
    assert "not a valid record file" not in caplog.text, "each file is reported once"
    assert os.path.exists("/etc/hostname"), "a symlink is moved, never followed"


def test_restart_of_either_side_loses_nothing_and_reports_nothing_twice(tmp_path):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    write_run(nfs, 6)
    c = Collect()
    reader = c.reader(nfs)
    # the server processes records 0..2 and then stops (the others are left in the folder)
    for seq in range(3, 6):
        shutil.move(nfs / "rank0" / folder_record_name(RUN, 0, seq), tmp_path / str(seq))
    shutil.move(nfs / "rank0" / folder_end_name(RUN, 0), tmp_path / "end")
    reader.poll_once()
    assert c.seqs == [(RUN, 0), (RUN, 1), (RUN, 2)]
    # a crash between accept and delete leaves record 2 behind: it is read again and dropped as a duplicate
    for seq in range(3, 6):
        shutil.move(tmp_path / str(seq), nfs / "rank0" / folder_record_name(RUN, 0, seq))
    shutil.move(tmp_path / "end", nfs / "rank0" / folder_end_name(RUN, 0))
    write_run(nfs, 3, run_id="oldrun")  # plus a stream the reader has never seen
    os.unlink(nfs / "rank0" / folder_record_name("oldrun", 0, 0))  # ...of which record 0 was handled before
    reader.poll_once()
    assert sorted(c.seqs) == sorted([(RUN, i) for i in range(6)] + [("oldrun", 1), ("oldrun", 2)])
    assert c.intake.duplicates == 0

    # a restarted server (a new reader and intake) starts at the lowest file left, in order
    write_run(nfs, 4, run_id="later")
    c2 = Collect()
    c2.reader(nfs).poll_once()
    assert c2.seqs == [("later", i) for i in range(4)]

    # a restarted agent is a new run: both runs' records are kept apart
    write_run(nfs, 2, run_id="again")
    c2.reader(nfs).poll_once()
    assert c2.seqs[-2:] == [("again", 0), ("again", 1)] and {e.run_id for e in c2.ends} == {"later", "again"}


def test_agent_keeps_training_while_the_folder_is_unwritable(tmp_path, caplog):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    (nfs / "rank0").write_text("a file where the rank folder should be")
    transport = FolderTransport(str(nfs), RUN, 0, 1, max_retry_s=0.05)
    sender = Sender(transport, budget_bytes=64 << 20)
    with caplog.at_level(logging.WARNING, logger="npu_agent"):
        for i in range(3):
            assert sender.submit(make_record(i)), "the training thread is not blocked"
        deadline = time.monotonic() + 10
        while "cannot write" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a few retries
        transport.close()  # what send_end does at the end; here directly, to keep the test short
        counts = sender.close(timeout=0.5)
    assert counts["acknowledged"] == 0 and counts["unacknowledged"] == 3
    assert caplog.text.count("cannot write") == 1, "one warning, not one per record"
    assert "Shared folder" in transport.describe_state()


def test_end_to_end_training_first_then_the_server_reads_what_is_left(tmp_path):
    """The agent needs no server to run; a server started (or restarted) later reads everything left."""
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    cfg = support.agent_config(str(tmp_path / "agent.json"), nfs_path=str(nfs))
    proc = support.run_training(support.SMALL_TRAIN, cfg, "2", "info")
    assert "Traceback" not in proc.stderr
    assert "unacknowledged 0" in proc.stderr
    left = listing(nfs)
    assert left and any(n.endswith(".end") for n in left)
    srv = support.Server(str(tmp_path), nfs_path=str(nfs), args=["--exit-when-done", "--world-size", "1"])
    srv.start()
    try:
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.kill()
    rows = support.read_csv(srv.out, "accuracy_checking_result")
    names = [(r["API name"], r["Step"]) for r in rows]
    assert sum(n.startswith("Functional.linear.") for n, _ in names) == 4
    assert len(names) == len(set(names)), "no row twice"
    assert listing(nfs) == [] and not (nfs / "rejected").exists()


def test_links_planted_in_the_shared_folder_are_never_followed(tmp_path, caplog):
    """A symlinked `rejected/` once turned a dropped file into a `.pth` in site-packages. Now: nothing is moved into
    a `rejected/` that is not a real directory of the server's user, a `rank{r}` that is a link is not entered, and
    a record name that is a link is moved aside as the link itself, its target untouched."""
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    site = tmp_path / "site-packages"
    site.mkdir()
    victim = tmp_path / "home"
    victim.mkdir()
    (victim / "secret.txt").write_text("keep me")
    write_run(nfs, 2)
    rank0 = nfs / "rank0"
    good = (rank0 / folder_record_name(RUN, 0, 0)).read_bytes()
    (victim / folder_record_name(RUN, 1, 0)).write_bytes(good)
    os.symlink(site, nfs / "rejected")
    os.symlink(victim, nfs / "rank1")
    (rank0 / "evil.pth").write_text("import os; os.system('echo pwned')")
    os.symlink(victim / "secret.txt", rank0 / folder_record_name(RUN, 0, 7))
    c = Collect()
    reader = c.reader(nfs)
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        for _ in range(3):
            reader.poll_once()
    assert c.seqs == [(RUN, 0), (RUN, 1)], "the real records are processed"
    assert os.listdir(site) == [], "nothing is moved through the planted link"
    assert sorted(os.listdir(victim)) == sorted(["secret.txt", folder_record_name(RUN, 1, 0)])
    assert (victim / "secret.txt").read_text() == "keep me"
    assert "evil.pth" in os.listdir(rank0) and os.path.islink(rank0 / folder_record_name(RUN, 0, 7))
    assert "not a real directory owned by this server's user" in caplog.text
    assert "rank1 is not a directory" in caplog.text
    # once the link is replaced by a real directory, the garbage goes there (the link moved as a link)
    os.unlink(nfs / "rejected")
    caplog.clear()
    reader2 = Collect().reader(nfs)
    reader2.poll_once()
    moved = sorted(os.listdir(nfs / "rejected"))
    assert moved == sorted(["rank0_evil.pth", f"rank0_{folder_record_name(RUN, 0, 7)}"]), moved
    assert os.path.islink(nfs / "rejected" / f"rank0_{folder_record_name(RUN, 0, 7)}")
    assert (victim / "secret.txt").read_text() == "keep me"
    assert os.stat(nfs / "rejected").st_mode & 0o777 == 0o700


def test_an_end_marker_without_records_is_not_counted(tmp_path, caplog):
    """A fake end (a run and rank that never published a record) must not end a rank or stop the server."""
    nfs = tmp_path / "nfs"
    (nfs / "rank3").mkdir(parents=True)
    end = pb.Frame(end=pb.End(run_id="ghost", rank=3, last_seq=5)).SerializeToString()
    (nfs / "rank3" / folder_end_name("ghost", 3)).write_bytes(_frame_file([end]))
    write_run(nfs, 1)
    c = Collect()
    reader = c.reader(nfs)
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        for _ in range(3):
            reader.poll_once()
    assert [(e.run_id, e.rank) for e in c.ends] == [(RUN, 0)], c.ends
    assert "no record of run 'ghost' rank 3 reached this server" in caplog.text
    assert os.listdir(nfs / "rank3") == []


def test_file_names_that_reach_the_log_are_escaped(tmp_path, caplog):
    nfs = tmp_path / "nfs"
    (nfs / "rank0").mkdir(parents=True)
    (nfs / "rank0" / "x\n[gpu-server] ERROR forged").write_bytes(b"junk")
    reader = Collect().reader(nfs)
    with caplog.at_level(logging.WARNING, logger="gpu_server"):
        reader.poll_once()
    assert "x\\n[gpu-server] ERROR forged" in caplog.text
    assert not any(line.startswith("[gpu-server] ERROR forged") for r in caplog.records
                   for line in r.getMessage().splitlines())


def test_ranks_with_a_backlog_take_turns_one_file_each(tmp_path):
    """A folder written before the server started (bench/server.py --records): the reader hands the ranks' records
    to the intake alternately, in sequence order within each rank, so that with --workers 2 (one worker per rank)
    neither worker waits for the other rank's backlog to be read first."""
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    for rank in (0, 1, 2):
        write_run(nfs, 4 if rank < 2 else 2, rank=rank)
    c = Collect()
    reader = c.reader(nfs)
    assert reader.poll_once()
    got = [(j.rank, j.seq) for j in c.jobs]
    assert got == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert sorted(e.rank for e in c.ends) == [0, 1, 2], "each rank's end marker after its records"
    assert all(listing(nfs, r) == [] for r in (0, 1, 2))
    assert not reader.poll_once()
