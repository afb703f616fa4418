"""Durable acceptance and resume: the spool in `--out/spool/` (the parts: gpu_server/spool/segments.py, the record
format; gpu_server/spool/journal.py, what is complete; gpu_server/spool/recovery.py, the report files at restart;
gpu_server/spool/acks.py, the tickets).

    state.json        {"ts": "20260101120000", "starts": 3, "format": 1}: the report files' `{ts}`, kept across
                      restarts
    lock              flock'ed by the running server: two servers never share one --out
    journal.log       which records are completely reported, the report files' sizes then, the end messages
    seg-000000042.spl one group commit: the records that arrived together (written, fsync'ed, renamed)
    damaged/          a hard link to each segment found damaged at a start, kept for inspection
    kept/             `--keep-records` only: the completely reported segments, for `gpu-server recheck`

A record is acknowledged once the segment holding it is fsync'ed and renamed into place (one fsync per batch of
records arriving together, whatever the number of streams: group commit). A full disk pauses the commits (no
acknowledgement, gpu_server/disk.py) instead of failing them. A segment is deleted once every record in it is
completely reported and the journal saying so is fsync'ed; with `--keep-records` (off by default: kept records
cost as much disk as the training sent) it is renamed into `kept/` instead, which a restart never replays and
`gpu-server recheck` reads (gpu_server/tools/offline.py). `kept/` must be a folder itself, not a link.

Resume (same `--out`): the report files are cut back to the journal (gpu_server/spool/recovery.py), every spool
entry not journaled as done is handed back (those marked `h` rebuild their pending backward check without writing
rows twice: gpu_server/checking/pending.py), the (run, rank, seq) seen are seeded from the journal and the spool so that
re-sent records are acknowledged as DUPLICATE, and the end messages are applied again. The report files keep the
earlier `{ts}`.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import glob
import json
import logging
import os
import re
import threading
import time
from typing import Iterator

from gpu_server.atomic_file import write_atomic
from gpu_server.spool.acks import GroupCommit, Ticket
from gpu_server.spool.journal import Journal, JournalState, read_journal
from gpu_server.spool.recovery import cut_reports, rebuild_from_reports
from gpu_server.spool.segments import (
    KEPT_DIR,
    Damage,
    Entry,
    is_real_dir,
    list_segments,
    read_entry,
    scan_segment,
    segment_files,
    segment_path,
)
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

__all__ = ["Entry", "Recovery", "Spool", "SpoolError", "Ticket"]

log = logging.getLogger("gpu_server")

Key = tuple  # (run_id, rank, seq)


class SpoolError(RuntimeError):
    """The spool cannot be used (locked by another server, unreadable state)."""


@dataclasses.dataclass
class Recovery:
    ts: str
    resumed: bool
    starts: int
    replay: list[Entry]              # not completely reported, in (run, rank, seq) order
    half: set[Key]                   # of those: forward records whose detail rows are written already
    ends: list[dict]
    truncated: dict[str, int]        # report file -> bytes cut off
    done_count: int
    damage: list[Damage] = dataclasses.field(default_factory=list)   # unreadable regions of spool segments
    journal_damaged: str = ""        # why the journal could not be trusted ("" when it could)
    rebuilt: int = 0                 # with a damaged journal: spooled records found in the report files
    quarantined: dict[Key, str] = dataclasses.field(default_factory=dict)   # of `replay`: never replayed (why)


class Spool:
    def __init__(self, out_dir: str, limits: Limits = DEFAULT_LIMITS, fsync: bool = True, keep: bool = False):
        self.out_dir = out_dir
        self.dir = os.path.join(out_dir, "spool")
        self.keep = keep                           # move completely reported segments to kept/ (not delete)
        self.kept_dir = os.path.join(self.dir, KEPT_DIR)
        self._keep_failed = False
        self.limits = limits
        self.fsync = fsync
        self._cv = threading.Condition()
        self._where: dict[Key, int] = {}           # durable, not completely reported -> segment
        self._live: dict[int, int] = {}            # segment -> entries not completely reported
        self.commits = GroupCommit(self._cv, self.dir, fsync, self._durable, self._unlink_segment)
        self.stats = self.commits.stats
        self.state = JournalState()
        self.journal: Journal | None = None
        self._lock_fd = -1

    # -- start-up ----------------------------------------------------------------------------------------------
    def open(self, default_ts: str) -> Recovery:
        os.makedirs(self.dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise SpoolError(f"{self.dir} is in use by another gpu-server; give each server its own --out") \
                    from None
            raise
        if self.keep:
            if os.path.lexists(self.kept_dir) and not is_real_dir(self.kept_dir):
                raise SpoolError(f"{self.kept_dir} is not a folder (a link or a file); remove it, or run without "
                                 "--keep-records")
            os.makedirs(self.kept_dir, exist_ok=True)
        for tmp in glob.glob(os.path.join(self.dir, "*.tmp")):  # never acknowledged: the agents re-send them
            os.unlink(tmp)
        state_path = os.path.join(self.dir, "state.json")
        saved = _read_json(state_path)
        resumed = re.fullmatch(r"\d{14}", str(saved.get("ts", ""))) is not None
        ts = saved["ts"] if resumed else default_ts
        starts = int(saved.get("starts", 0)) + 1 if resumed else 1
        state = {"ts": ts, "starts": starts, "format": 1}
        write_atomic(state_path, lambda fh: json.dump(state, fh), fsync=self.fsync)

        journal_path = os.path.join(self.dir, "journal.log")
        self.state = state = read_journal(journal_path)
        if resumed and not state.exists:
            state.damaged = f"{journal_path} is missing"
        entries, damage = self._scan_segments()
        rebuilt = 0
        if state.damaged:
            kept = self._keep_damaged(journal_path)
            state = self.state = JournalState(damaged=state.damaged, exists=state.exists)
            rebuilt = rebuild_from_reports(self.out_dir, ts, entries, state) if resumed else 0
            log.error("spool: the journal is damaged (%s)%s; the report files are kept as they are and %d spooled "
                      "records were found reported in them; the others are checked again", state.damaged,
                      f", kept as {kept}" if kept else "", rebuilt)
        replay = []
        for e in entries:
            if state.is_done(e.key) or e.key in self._where:
                continue
            replay.append(e)
            self._where[e.key] = e.segment
            self._live[e.segment] = self._live.get(e.segment, 0) + 1
        for seg in list_segments(self.dir):
            if not self._live.get(seg):
                self._unlink_segment(seg)
        truncated = cut_reports(self.out_dir, ts, state, self.fsync) if resumed else {}
        self.journal = Journal(journal_path, self.fsync, self._journaled)
        self.journal.open(state)
        replay.sort(key=lambda e: (e.key[0], e.key[1], e.key[2]))
        half = {e.key for e in replay if e.key in state.half}
        kept = [seg for seg, _ in segment_files(self.kept_dir)]   # numbers stay unique across live and kept/
        self.commits.start(max(list_segments(self.dir) + kept, default=-1) + 1)
        return Recovery(ts=ts, resumed=resumed, starts=starts, replay=replay, half=half,
                        ends=list(state.ends.values()), truncated=truncated, done_count=state.done_count(),
                        damage=damage, journal_damaged=state.damaged, rebuilt=rebuilt,
                        quarantined={e.key: state.quarantined[e.key] for e in replay if e.key in state.quarantined})

    def _keep_damaged(self, path: str) -> str:
        if not os.path.exists(path):
            return ""
        kept = f"{path}.damaged-{time.strftime('%Y%m%d%H%M%S')}"
        os.replace(path, kept)
        return kept

    def seen(self) -> Iterator[Key]:
        """Every (run, rank, seq) this --out has accepted: completely reported or still in the spool."""
        for (run, rank), seqs in self.state.done.items():
            for seq in seqs:
                yield run, rank, seq
        yield from self._where

    def _scan_segments(self) -> tuple[list[Entry], list[Damage]]:
        entries: list[Entry] = []
        damage: list[Damage] = []
        for seg in list_segments(self.dir):
            path = segment_path(self.dir, seg)
            try:
                found, bad = scan_segment(seg, path, self.limits)
            except (OSError, ValueError) as exc:
                found, bad = [], [Damage(seg, 0, 0, f"unreadable: {exc}")]
            entries.extend(found)
            if bad:
                damage.extend(bad)
                kept = os.path.join(self.dir, "damaged", os.path.basename(path))
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                if not os.path.exists(kept):
                    os.link(path, kept)
                log.error("spool: %s is damaged (%s); %d records in it are readable and kept, %d bytes are not "
                          "(a copy is in %s; records lost there were acknowledged and cannot be reported)",
                          path, "; ".join(d.why for d in bad), len(found), sum(d.skipped for d in bad), kept)
        return entries, damage

    def read(self, entry: Entry, payload: bytearray | None = None) -> tuple[pb.Record, bytearray]:
        """The spooled record and its payload, checksums verified (the intake validates the rest)."""
        return read_entry(self.dir, entry, payload)

    # -- accepting (transport threads) -------------------------------------------------------------------------
    def append(self, record: pb.Record, payload: bytearray | memoryview, raw: bytes | None = None) -> Ticket:
        """Queue `record` for the next group commit (`raw`: its bytes, where the caller has them); the ticket is set
        ACCEPTED once it is durable."""
        h = record.header
        try:
            raw = raw if raw is not None else record.SerializeToString()
            return self.commits.append((h.run_id, h.rank, h.seq), raw, payload)
        except RuntimeError as exc:
            raise SpoolError(str(exc)) from None

    def pending(self, key: Key) -> Ticket | None:
        """The ticket of a record accepted but not yet durable (a duplicate waits for it), else None."""
        return self.commits.pending(key)

    def _durable(self, seg: int, keys: list[Key]) -> None:
        """(Under the lock.) Segment `seg` is durable and holds `keys` not yet completely reported."""
        for key in keys:
            self._where[key] = seg
        self._live[seg] = len(keys)

    # -- completion (worker threads) ---------------------------------------------------------------------------
    def complete(self, done: list[Key], half: list[Key], files: dict[str, int]) -> None:
        """Rows written for `done` (all of them) and `half` (forward detail rows); `files`: sizes right after."""
        if not done and not half and not files:
            return
        names = {os.path.basename(p): s for p, s in files.items()}
        self.journal.add({"d": [list(k) for k in done], "h": [list(k) for k in half], "f": names}, list(done),
                         files)
        self.commits.reported(list(done) + list(half))   # a record that could not be spooled: acknowledged now

    def quarantine(self, key: Key, why: str) -> None:
        """A record whose replay killed its worker process: journaled at once, so that a restart before its SKIP
        rows are journaled reports it SKIP instead of replaying it again (gpu_server/replay/sandbox.py)."""
        self.journal.add_now({"q": [[key[0], int(key[1]), int(key[2]), why[:500]]]})

    def record_end(self, end: dict) -> None:
        """Persist an end message before it is acknowledged."""
        self.journal.add_now({"end": end})

    def _journaled(self, keys: list[Key]) -> None:
        """The journal holds `keys` as done (fsync'ed): their segments can go once nothing else lives there."""
        dead = []
        with self._cv:
            for key in keys:
                seg = self._where.pop(key, None)
                if seg is None:
                    self.commits.done_before_durable(key)
                    continue
                self._live[seg] -= 1
                if self._live[seg] <= 0:
                    del self._live[seg]
                    dead.append(seg)
        for seg in dead:
            self._unlink_segment(seg)

    def _unlink_segment(self, seg: int) -> None:
        """Every record in `seg` is completely reported: delete it, or with `keep` move it into kept/."""
        path = segment_path(self.dir, seg)
        if self.keep and not self._keep_failed:
            target = segment_path(self.kept_dir, seg)
            try:
                if not os.path.lexists(target):
                    os.rename(path, target)   # same filesystem; a restart never replays kept/
                    return
                log.error("spool: %s exists already (not written by this server); %s is deleted, not kept", target,
                          path)
            except FileNotFoundError:
                if not os.path.lexists(path):
                    return                # moved or deleted already
                self._keep_failed = True
                log.error("spool: %s is gone; completely reported records are deleted from now on, not kept",
                          self.kept_dir)
            except OSError as exc:
                self._keep_failed = True
                log.error("spool: cannot keep %s in %s (%s); completely reported records are deleted from now on",
                          path, self.kept_dir, exc)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def kept_usage(self) -> tuple[int, int]:
        """(segment files, bytes) in kept/: what `--keep-records` costs on disk so far."""
        files = segment_files(self.kept_dir)
        total = 0
        for _seg, path in files:
            try:
                total += os.lstat(path).st_size
            except OSError:
                pass
        return len(files), total

    # -- shutdown ----------------------------------------------------------------------------------------------
    def flush(self, timeout: float = 60.0) -> None:
        """Wait for queued commits, then journal what is complete."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.commits.busy() and time.monotonic() < deadline:
                self._cv.wait(0.05)
        if self.journal is not None:
            self.journal.flush()

    def close(self) -> None:
        self.flush()
        self.commits.close()
        if self.journal is not None:
            self.journal.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def live_records(self) -> int:
        with self._cv:
            return len(self._where) + self.commits.inflight()


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}

