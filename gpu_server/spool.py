"""Durable acceptance and resume (SPEC §4 "Delivery", §5.1 "A restart with the same --out resumes").

Layout of `--out/spool/`:

    state.json        {"ts": "20260101120000", "starts": 3}: the report files' `{ts}`, kept across restarts
    lock              flock'ed by the running server: two servers never share one --out
    journal.log       append-only JSON lines: which records are completely reported, the report files' sizes
                      at that moment, the end messages received
    seg-000000042.spl one group commit: the records that arrived together (written, fsync'ed, renamed)

A record is acknowledged once the segment holding it is fsync'ed and renamed into place (one fsync per batch of
records arriving together, whatever the number of streams: group commit). A segment is deleted once every record
in it is completely reported and the journal saying so is fsync'ed.

Segment format (little-endian, no pickle): the magic `OCSPOOL1`, then per record `REC1`, header length (u32),
payload length (u64), crc32 of the header (u32), crc32 of the payload (u32), the serialized `Record` (the wire
header, `payload_bytes` included) and the raw payload. Reading validates the magic, the lengths against the file
and the limits, both checksums and the header's own `payload_bytes`; the intake then validates the record again
exactly as if it had come off the wire.

Journal lines (fsync'ed in groups by a background thread, after the report files they describe):

    {"d": [[run, rank, seq], ...], "h": [[run, rank, seq], ...], "f": {"accuracy_checking_result_..csv": 1234}}
    {"end": {"run_id": .., "rank": .., "captured": .., ...}}
    {"snapshot": {...}}   (first line after a restart: the compacted state)

`d`: the record's rows are all written (its spool entry can go); `h`: a forward record whose detail rows are written
while its result row waits for the backward record (it stays in the spool: its inputs are needed for the backward
replay); `f`: the sizes of the report files right after those rows. Only one worker thread writes a rank's files,
so every `f` describes exactly the rows of the records marked so far.

Resume (same `--out`): sizes of the report files are cut back to the last journaled sizes (rows of records that
were not yet journaled, and any half-written row, disappear), then every spool entry not marked `d` is handed to
the workers again (`h` entries silently, to rebuild the pending backward check without writing their detail rows
twice), the set of (run, rank, seq) seen is seeded from the journal and the spool so that re-sent records are
acknowledged as DUPLICATE, and the end messages are applied again. The report files keep the earlier run's
`{ts}`: a resumed server appends to the files it wrote before instead of starting a second set.
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
import struct
import threading
import time
import zlib
from typing import Iterator

from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger("gpu_server")

MAGIC = b"OCSPOOL1"
_ENTRY = struct.Struct("<4sIQII")
_TAG = b"REC1"
_SEGMENT = re.compile(r"^seg-(\d{9,})\.spl$")
_REPORT = re.compile(r"^(accuracy_checking_result|accuracy_checking_details|api_precision_compare_result|"
                     r"api_precision_compare_details)_(\d{14})_rank(\d+)\.csv$")
_BATCH_BYTES = 256 << 20        # one group commit writes at most this much (then the next batch starts)
_JOURNAL_INTERVAL_S = 0.05      # completions are journaled in groups at most this often

Key = tuple  # (run_id, rank, seq)


class SpoolError(RuntimeError):
    """The spool cannot be used (locked by another server, unreadable state)."""


class Ticket:
    """The acknowledgement of one record, ready once the record is durable (or at once for immediate answers)."""

    __slots__ = ("_event", "status", "reason", "seq", "after")

    def __init__(self, seq: int = 0, status: int | None = None, reason: str = "", after: Ticket | None = None):
        self._event = threading.Event()
        self.seq, self.status, self.reason = seq, status, reason
        self.after = after   # answer only once this earlier ticket is ready (a duplicate, a spooled rejection)
        if status is not None:
            self._event.set()

    def set(self, status: int, reason: str = "") -> None:
        if not self._event.is_set():
            self.status, self.reason = status, reason
            self._event.set()

    def ready(self) -> bool:
        return self._event.is_set() and (self.after is None or self.after.ready())

    def wait(self, timeout: float | None = None) -> tuple[int, str]:
        if self.after is not None:
            self.after.wait(timeout)
        self._event.wait(timeout)
        return self.status, self.reason


@dataclasses.dataclass
class Entry:
    """Where one spooled record lies."""

    key: Key
    segment: int
    offset: int              # of the header bytes
    header_len: int
    payload_len: int


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


class Spool:
    def __init__(self, out_dir: str, limits: Limits = DEFAULT_LIMITS, fsync: bool = True):
        self.out_dir = out_dir
        self.dir = os.path.join(out_dir, "spool")
        self.limits = limits
        self.fsync = fsync
        self._cv = threading.Condition()
        self._queue: list[tuple[Key, bytes, bytearray | memoryview, Ticket, int]] = []
        self._queued_bytes = 0
        self._inflight: dict[Key, Ticket] = {}     # appended, not yet durable
        self._where: dict[Key, int] = {}           # durable, not completely reported -> segment
        self._live: dict[int, int] = {}            # segment -> entries not completely reported
        self._done_early: set[Key] = set()         # completely reported before its segment was durable
        self._fallback: dict[Key, Ticket] = {}     # could not be spooled: acknowledged once reported
        self.done: dict[tuple[str, int], set[int]] = {}
        self.half: set[Key] = set()
        self.files: dict[str, int] = {}
        self.ends: dict[tuple[str, int], dict] = {}
        self._journal_buf: list[str] = []
        self._journal_keys: list[Key] = []
        self._journal_files: set[str] = set()
        self._journal_cv = threading.Condition()
        self._journal_fh = None
        self._next_segment = 0
        self._closed = False
        self._lock_fd = -1
        self._failed_once = False
        self.stats = {"segments": 0, "records": 0, "bytes": 0, "fsyncs": 0}
        self._threads: list[threading.Thread] = []

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
        for tmp in glob.glob(os.path.join(self.dir, "*.tmp")):  # never acknowledged: the agents re-send them
            os.unlink(tmp)
        state_path = os.path.join(self.dir, "state.json")
        state = _read_json(state_path)
        resumed = bool(state.get("ts")) and re.fullmatch(r"\d{14}", str(state.get("ts"))) is not None
        ts = state["ts"] if resumed else default_ts
        starts = int(state.get("starts", 0)) + 1 if resumed else 1
        _write_json_atomic(state_path, {"ts": ts, "starts": starts, "format": 1}, self.fsync)

        self._read_journal()
        entries = self._scan_segments()
        replay = []
        for e in entries:
            if self._is_done(e.key):
                continue
            replay.append(e)
            self._where[e.key] = e.segment
            self._live[e.segment] = self._live.get(e.segment, 0) + 1
        for seg in self._segments():
            if not self._live.get(seg):
                self._unlink_segment(seg)
        self._next_segment = max(self._segments(), default=-1) + 1
        truncated = self._truncate_reports(ts) if resumed else {}
        self._compact_journal()
        replay.sort(key=lambda e: (e.key[0], e.key[1], e.key[2]))
        half = {e.key for e in replay if e.key in self.half}
        for name, target in (("gpu-server-spool", self._commit_loop), ("gpu-server-journal", self._journal_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return Recovery(ts=ts, resumed=resumed, starts=starts, replay=replay, half=half,
                        ends=list(self.ends.values()), truncated=truncated,
                        done_count=sum(len(s) for s in self.done.values()))

    def seen(self) -> Iterator[Key]:
        """Every (run, rank, seq) this --out has accepted: completely reported or still in the spool."""
        for (run, rank), seqs in self.done.items():
            for seq in seqs:
                yield run, rank, seq
        yield from self._where

    def _is_done(self, key: Key) -> bool:
        return key[2] in self.done.get((key[0], key[1]), ())

    def _read_journal(self) -> None:
        path = os.path.join(self.dir, "journal.log")
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return
        with fh:
            for n, line in enumerate(fh):
                try:
                    item = json.loads(line)
                except ValueError:
                    log.warning("spool: journal line %d is cut off (the server was killed while writing it); "
                                "the records it named are checked again", n + 1)
                    continue
                if not isinstance(item, dict):
                    continue
                if "snapshot" in item:
                    snap = item["snapshot"]
                    for run, ranks in snap.get("done", {}).items():
                        for rank, ranges in ranks.items():
                            seqs = self.done.setdefault((run, int(rank)), set())
                            for a, b in ranges:
                                seqs.update(range(int(a), int(b) + 1))
                    self.half = {tuple(k) for k in snap.get("half", [])}
                    self.files.update({k: int(v) for k, v in snap.get("files", {}).items()})
                    for end in snap.get("ends", []):
                        self.ends[(end["run_id"], int(end["rank"]))] = end
                    continue
                for run, rank, seq in item.get("d", []):
                    self.done.setdefault((run, int(rank)), set()).add(int(seq))
                    self.half.discard((run, int(rank), int(seq)))
                for run, rank, seq in item.get("h", []):
                    self.half.add((run, int(rank), int(seq)))
                self.files.update({k: int(v) for k, v in item.get("f", {}).items()})
                if "end" in item:
                    end = item["end"]
                    self.ends[(end["run_id"], int(end["rank"]))] = end
        self.half = {k for k in self.half if not self._is_done(k)}

    def _segments(self) -> list[int]:
        out = []
        for name in os.listdir(self.dir):
            m = _SEGMENT.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _segment_path(self, seg: int) -> str:
        return os.path.join(self.dir, f"seg-{seg:09d}.spl")

    def _scan_segments(self) -> list[Entry]:
        entries: list[Entry] = []
        for seg in self._segments():
            path = self._segment_path(seg)
            try:
                entries.extend(self._scan_segment(seg, path))
            except (OSError, ValueError) as exc:
                log.error("spool: %s is damaged (%s); the records before the damage are kept", path, exc)
        return entries

    def _scan_segment(self, seg: int, path: str) -> list[Entry]:
        out: list[Entry] = []
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a spool segment (bad magic)")
            pos = len(MAGIC)
            while pos < size:
                head = fh.read(_ENTRY.size)
                if len(head) != _ENTRY.size:
                    raise ValueError(f"entry header cut off at byte {pos}")
                tag, hlen, plen, hcrc, pcrc = _ENTRY.unpack(head)
                if tag != _TAG or hlen > self.limits.max_frame_bytes or plen > self.limits.max_record_bytes:
                    raise ValueError(f"bad entry at byte {pos}")
                start = pos + _ENTRY.size
                if start + hlen + plen > size:
                    raise ValueError(f"entry at byte {pos} runs past the end of the file")
                header = fh.read(hlen)
                if zlib.crc32(header) != hcrc:
                    raise ValueError(f"entry at byte {pos}: header checksum mismatch")
                record = pb.Record.FromString(header)
                if record.payload_bytes != plen:
                    raise ValueError(f"entry at byte {pos}: payload length disagrees with the record")
                h = record.header
                out.append(Entry((h.run_id, h.rank, h.seq), seg, start, hlen, plen))
                fh.seek(start + hlen + plen)
                pos = start + hlen + plen
        return out

    def read(self, entry: Entry, payload: bytearray | None = None) -> tuple[pb.Record, bytearray]:
        """The spooled record and its payload, checksums verified (the intake validates the rest)."""
        with open(self._segment_path(entry.segment), "rb") as fh:
            fh.seek(entry.offset - _ENTRY.size)
            tag, hlen, plen, hcrc, pcrc = _ENTRY.unpack(fh.read(_ENTRY.size))
            if (tag, hlen, plen) != (_TAG, entry.header_len, entry.payload_len):
                raise ValueError("spool entry moved")
            header = fh.read(hlen)
            data = payload if payload is not None else bytearray(plen)
            view = memoryview(data)
            got = 0
            while got < plen:
                n = fh.readinto(view[got:])
                if not n:
                    raise ValueError("spool entry cut off")
                got += n
        if zlib.crc32(header) != hcrc or zlib.crc32(data) != pcrc:
            raise ValueError("spool entry checksum mismatch")
        return pb.Record.FromString(header), data

    def _truncate_reports(self, ts: str) -> dict[str, int]:
        """Cut every report file of this session back to its journaled size (or to nothing if never journaled)."""
        cut: dict[str, int] = {}
        for name in os.listdir(self.out_dir):
            m = _REPORT.match(name)
            if not m or m.group(2) != ts:
                continue
            path = os.path.join(self.out_dir, name)
            size = os.path.getsize(path)
            keep = self.files.get(name, 0)
            if size > keep:
                with open(path, "r+b") as fh:
                    fh.truncate(keep)
                    if self.fsync:
                        os.fsync(fh.fileno())
                cut[name] = size - keep
            elif size < keep:
                log.warning("spool: %s is shorter (%d bytes) than journaled (%d): rows were lost with the page "
                            "cache (power failure?)", name, size, keep)
                self.files[name] = size
        return cut

    def _compact_journal(self) -> None:
        done: dict[str, dict[str, list]] = {}
        for (run, rank), seqs in sorted(self.done.items()):
            done.setdefault(run, {})[str(rank)] = _ranges(seqs)
        snap = {"done": done, "half": sorted(list(k) for k in self.half), "files": self.files,
                "ends": list(self.ends.values())}
        path = os.path.join(self.dir, "journal.log")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"snapshot": snap}, separators=(",", ":")) + "\n")
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        self._fsync_dir()
        self._journal_fh = open(path, "a", encoding="utf-8")

    # -- accepting (transport threads) -------------------------------------------------------------------------
    def append(self, record: pb.Record, payload: bytearray | memoryview) -> Ticket:
        """Queue `record` for the next group commit; the ticket is set ACCEPTED once it is durable."""
        h = record.header
        key = (h.run_id, h.rank, h.seq)
        ticket = Ticket(h.seq)
        header = record.SerializeToString()
        with self._cv:
            if self._closed:
                raise SpoolError("the spool is closed")
            self._inflight[key] = ticket
            self._queue.append((key, header, payload, ticket, len(payload)))
            self._queued_bytes += len(payload)
            self._cv.notify_all()
        return ticket

    def pending(self, key: Key) -> Ticket | None:
        """The ticket of a record accepted but not yet durable (a duplicate waits for it), else None."""
        with self._cv:
            return self._inflight.get(key) or self._fallback.get(key)

    def _commit_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and (not batch or size + self._queue[0][4] <= _BATCH_BYTES):
                    item = self._queue.pop(0)
                    batch.append(item)
                    size += item[4]
                self._queued_bytes -= size
                seg = self._next_segment
                self._next_segment += 1
            try:
                self._write_segment(seg, batch)
            except OSError as exc:
                if not self._failed_once:
                    self._failed_once = True
                    log.error("spool: cannot write %s (%s); records are acknowledged only once their rows are "
                              "written, and are not kept across a restart", self.dir, exc)
                with self._cv:
                    for key, _h, _p, ticket, _n in batch:
                        self._inflight.pop(key, None)
                        if key in self._done_early:
                            self._done_early.discard(key)
                            ticket.set(pb.Ack.ACCEPTED)
                        else:
                            self._fallback[key] = ticket
                continue
            with self._cv:
                live = 0
                for key, _h, _p, _t, _n in batch:
                    self._inflight.pop(key, None)
                    if key in self._done_early:
                        self._done_early.discard(key)
                    else:
                        self._where[key] = seg
                        live += 1
                self._live[seg] = live
                self.stats["segments"] += 1
                self.stats["records"] += len(batch)
                self.stats["bytes"] += size
            if not live:
                self._unlink_segment(seg)
            for *_rest, ticket, _n in batch:
                ticket.set(pb.Ack.ACCEPTED)

    def _write_segment(self, seg: int, batch) -> None:
        path = self._segment_path(seg)
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(MAGIC)
            for _key, header, payload, _ticket, plen in batch:
                fh.write(_ENTRY.pack(_TAG, len(header), plen, zlib.crc32(header), zlib.crc32(payload)))
                fh.write(header)
                fh.write(payload)
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
                self.stats["fsyncs"] += 1
        os.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- completion (worker threads) ---------------------------------------------------------------------------
    def complete(self, done: list[Key], half: list[Key], files: dict[str, int]) -> None:
        """Rows written for `done` (all of them) and `half` (forward detail rows); `files`: sizes right after."""
        if not done and not half and not files:
            return
        names = {os.path.basename(p): s for p, s in files.items()}
        line = json.dumps({"d": [list(k) for k in done], "h": [list(k) for k in half], "f": names},
                          separators=(",", ":"))
        with self._journal_cv:
            self._journal_buf.append(line)
            self._journal_keys.extend(done)
            self._journal_files.update(files)
            self._journal_cv.notify_all()
        with self._cv:
            for key in done + half:  # a record waiting for durability by its rows (spool not writable)
                t = self._fallback.pop(key, None)
                if t is not None:
                    t.set(pb.Ack.ACCEPTED)

    def record_end(self, end: dict) -> None:
        """Persist an end message before it is acknowledged."""
        self.ends[(end["run_id"], int(end["rank"]))] = end
        with self._journal_cv:
            self._journal_buf.append(json.dumps({"end": end}, separators=(",", ":")))
            self._flush_journal_locked()

    def _journal_loop(self) -> None:
        while True:
            with self._journal_cv:
                while not self._journal_buf and not self._closed:
                    self._journal_cv.wait()
                if not self._journal_buf and self._closed:
                    return
                self._flush_journal_locked()
            time.sleep(_JOURNAL_INTERVAL_S)

    def _flush_journal_locked(self) -> None:
        if not self._journal_buf or self._journal_fh is None:
            return
        lines, keys, files = self._journal_buf, self._journal_keys, self._journal_files
        self._journal_buf, self._journal_keys, self._journal_files = [], [], set()
        if self.fsync:  # the rows first, then the journal that says they are there
            for path in files:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self._journal_fh.write("\n".join(lines) + "\n")
        self._journal_fh.flush()
        if self.fsync:
            os.fsync(self._journal_fh.fileno())
        dead = []
        with self._cv:
            for key in keys:
                self.done.setdefault((key[0], key[1]), set()).add(key[2])
                seg = self._where.pop(key, None)
                if seg is None:
                    if key in self._inflight:
                        self._done_early.add(key)
                    continue
                self._live[seg] -= 1
                if self._live[seg] <= 0:
                    del self._live[seg]
                    dead.append(seg)
        for seg in dead:
            self._unlink_segment(seg)

    def _unlink_segment(self, seg: int) -> None:
        try:
            os.unlink(self._segment_path(seg))
        except FileNotFoundError:
            pass

    # -- shutdown ----------------------------------------------------------------------------------------------
    def flush(self, timeout: float = 60.0) -> None:
        """Wait for queued commits, then journal what is complete."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self._queue or self._inflight) and time.monotonic() < deadline:
                self._cv.wait(0.05)
        with self._journal_cv:
            self._flush_journal_locked()

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        with self._journal_cv:
            self._journal_cv.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        with self._journal_cv:
            self._flush_journal_locked()
            if self._journal_fh is not None:
                self._journal_fh.close()
                self._journal_fh = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def live_records(self) -> int:
        with self._cv:
            return len(self._where) + len(self._inflight)


def _ranges(seqs) -> list[list[int]]:
    out: list[list[int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: str, data: dict, fsync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)

