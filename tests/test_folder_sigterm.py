"""The shared folder at SIGTERM (issue 24, item 6): the agent counts every record file it published as delivered, so a
server stopped with SIGTERM (as the README says) reads every complete record file already in the folder, spools and
checks it, then drains: this run's report has a row for every record and no record file is left. The sweep reads
within `--memory-mb` like the steady reader (each frame reserved before it is read).

A real gpu-server process watches a real folder. It is paused (SIGSTOP) while the files arrive, standing in for a
server that lags behind the training (the audit's case: 27 files still unread at the stop), then gets SIGTERM and
continues: without the sweep those files stayed in the folder and this run's report was short."""
from __future__ import annotations

import os
import signal
import threading
import time

from gpu_server.intake.folder import FolderReader
from protos.folder_format import folder_record_name
from protos.limits import MiB
from tests import support
from tests.test_byte_budget import (
    FOLDER_MEMORY,
    FOLDER_RECORDS,
    _wait_rows,
    folder_of_rank0,
    publish_folder_record,
    rss_now,
)
from tests.test_durability import TRAIN, check_exactly_once, counts_of, summary_of
from tests.test_folder import RUN, Collect, write_run


def _stop_paused(srv: support.Server) -> int:
    """Let a paused server continue and send it SIGTERM at once; its exit code once it has drained. (SIGCONT first:
    a signal sent to a stopped process may be taken by any of its threads when it continues, and the main thread
    then sees it only at its next wake-up, seconds later; sent to a running process it goes to the main thread.)"""
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGCONT)
    return srv.stop(timeout=240)


def _sample_peak(pid: int, samples: list[int]) -> None:
    while True:
        try:
            samples.append(support.memory_of(pid, "VmHWM"))
        except (OSError, ValueError):   # exited (a zombie's status has no VmHWM: 0 is appended, harmless)
            return
        if samples[-1] == 0:
            return
        time.sleep(0.01)


def test_sigterm_right_after_the_training_reports_every_record_file_in_the_folder(tmp_path):
    work = str(tmp_path)
    nfs = os.path.join(work, "nfs")
    os.makedirs(nfs)
    steps = 8
    srv = support.Server(work, nfs_path=nfs).start()
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)   # the server falls behind: every file of the run waits in the folder
        proc = support.run_training(TRAIN, support.agent_config(os.path.join(work, "agent.json"), nfs_path=nfs),
                                    str(steps), "0", "1", "64", timeout=180)
        waiting = [n for n in os.listdir(os.path.join(nfs, "rank0")) if not n.startswith(".")]
        code = _stop_paused(srv)                # right after the training ended
    finally:
        srv.kill()
    assert code == 0, srv.log()[-3000:]
    counts = counts_of(proc)
    assert counts["dropped"] == 0 and counts["unacknowledged"] == 0 and counts["rejected"] == 0, counts
    assert len(waiting) > 1, waiting   # record files and the end marker were there at the stop
    per_step = check_exactly_once(srv.out, 0, steps)
    calls = sum(len(v) for v in per_step.values())
    backward = {(r["API Name"].split(".backward.")[0], r["Step"])
                for r in support.read_csv(srv.out, "accuracy_checking_details") if ".backward." in r["API Name"]}
    assert calls + len(backward) == counts["captured"], (calls, len(backward), counts)
    assert os.listdir(os.path.join(nfs, "rank0")) == [], "record files left in the folder"
    summary = summary_of(srv.out)
    transport = summary["transport"]
    # How many files the sweep read rather than the steady reader depends on which thread runs first after SIGCONT
    # (on a loaded machine the steady reader may take them all): the sweep itself is pinned deterministically by
    # test_stop_sweeps_the_folder_without_waiting_for_a_missing_record below.
    assert transport["rejected"] == 0 and transport["spool_left"] == 0, transport
    assert sum(summary["records_received"].values()) == counts["captured"], summary["records_received"]
    assert [e["rank"] for e in summary["ranks_ended"]] == [0], summary["ranks_ended"]   # its end marker too


def test_sigterm_with_a_folder_full_of_large_records_stays_within_the_budget(tmp_path):
    """docs/security.md: reading the shared folder, peak RSS <= start + --memory-mb + 64 MiB, at the stop as in the
    steady state (tests/test_byte_budget.py): 16 records of 12 MiB (each one's estimated peak 96 MiB) wait in the
    folder of a server with --memory-mb 128 when it gets SIGTERM; all are read, checked and reported."""
    work, nfs, rank_dir = folder_of_rank0(tmp_path)
    memory, records = FOLDER_MEMORY, FOLDER_RECORDS

    srv = support.Server(work, nfs_path=nfs, args=("--memory-mb", str(memory // MiB), "--replay-in", "thread"))
    srv.start()
    try:
        publish_folder_record(rank_dir, "warm", 0, 1 << 16)
        assert _wait_rows(srv.out, 1, 60) == 1
        time.sleep(0.5)
        base = rss_now(srv.proc.pid)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        for seq in range(records):
            publish_folder_record(rank_dir, "full", seq, (12 * MiB) // 8)
        # a temporary file being written at the stop: never read, never removed (the agent renames or removes it)
        partial = os.path.join(rank_dir, "." + folder_record_name("full", 0, records) + ".123.abcd.tmp")
        with open(partial, "wb") as fh:
            fh.write(b"OCFRAME1")
        # The peak RSS of the server's own image: VmHWM, sampled until it exits (monotonic, so the last sample is the
        # peak but for its last milliseconds). Not wait4's ru_maxrss: that counts the pytest process's pages the
        # child shared between fork and exec, gigabytes late in a full test run.
        samples: list[int] = []
        sampler = threading.Thread(target=_sample_peak, args=(srv.proc.pid, samples), daemon=True)
        sampler.start()
        os.kill(srv.proc.pid, signal.SIGCONT)   # then SIGTERM at once (see _stop_paused)
        os.kill(srv.proc.pid, signal.SIGTERM)
        srv.proc.wait(240)
        sampler.join(10)
        peak = max(samples)
    finally:
        srv.kill()
    assert srv.proc.returncode == 0, srv.log()[-3000:]
    rows = len(support.read_csv(srv.out, "accuracy_checking_result"))
    assert rows == records + 1, (rows, srv.log()[-3000:])
    assert os.listdir(rank_dir) == [os.path.basename(partial)], os.listdir(rank_dir)
    transport = summary_of(srv.out)["transport"]
    assert transport["rejected"] == 0, transport
    bound = memory + 64 * MiB
    print(f"\nfolder at SIGTERM: {records} records of 12 MiB, --memory-mb {memory // MiB}: peak RSS {peak / MiB:.0f} "
          f"MiB, {(peak - base) / MiB:.0f} MiB above the {base / MiB:.0f} MiB before (bound {bound / MiB:.0f}); "
          f"{transport['folder_files_read_at_stop']} files read by the sweep")
    assert peak - base <= bound, ((peak - base) / MiB, bound / MiB)


def test_stop_sweeps_the_folder_without_waiting_for_a_missing_record(tmp_path):
    """In process: files published while the reader polls nothing are all handed to the intake by `stop`, in order,
    across a missing sequence number, end marker included; a halted reader leaves the rest for the next start."""
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    write_run(nfs, 6)
    os.unlink(nfs / "rank0" / folder_record_name(RUN, 0, 2))   # a gap that polling would wait for
    c = Collect()
    reader = c.reader(nfs, min_poll_s=3600, max_poll_s=3600)
    reader._stop.set()          # polling never ran: only the sweep reads
    reader.start()
    reader.stop(timeout=60)
    assert [seq for _, seq in c.seqs] == [0, 1, 3, 4, 5] and reader.swept == 5
    assert [e.rank for e in c.ends] == [0]
    assert os.listdir(nfs / "rank0") == []

    write_run(nfs, 3, run_id="later")
    c2 = Collect()
    halted = c2.reader(nfs)
    halted._halt.set()
    halted._stop.set()
    halted.start()
    halted.stop(timeout=60)
    assert c2.jobs == [] and halted.swept == 0 and len(os.listdir(nfs / "rank0")) == 4


def test_stop_without_sweep_leaves_the_files(tmp_path):
    nfs = tmp_path / "nfs"
    nfs.mkdir()
    write_run(nfs, 2)
    c = Collect()
    reader = FolderReader(str(nfs), c.intake, c.intake.limits, c.ends.append, sweep_on_stop=False)
    reader._stop.set()
    reader.start()
    reader.stop(timeout=60)
    assert c.jobs == [] and len(os.listdir(nfs / "rank0")) == 3
