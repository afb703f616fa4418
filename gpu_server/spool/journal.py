"""The spool's journal: `spool/journal.log`, append-only JSON lines, fsync'ed in groups after the report files.

    {"snapshot": {"done": {run: {rank: [[first, last], ...]}}, "half": [[run, rank, seq], ...],
                  "files": {report file name: size}, "ends": [{...}, ...]}}     always the first line
    {"d": [[run, rank, seq], ...], "h": [[run, rank, seq], ...], "f": {report file name: size}}
    {"end": {"run_id": .., "rank": .., "captured": .., ...}}
    {"q": [[run, rank, seq, why], ...]}

`d`: the record's rows are all written; `h`: a forward record whose detail rows are written while its result row
waits for the backward record; `f`: the sizes of the report files right after those rows. `q`: records quarantined
because their replay killed a replay worker process (gpu_server/replay/sandbox.py): a restart reports them SKIP and
never
replays them. Each start, and every
COMPACT_BYTES appended during a long session, compacts the journal into one snapshot line (written to a temporary
file, fsync'ed, renamed).

A journal whose first line is not a snapshot, or with an unreadable line before its last, is damaged: it cannot
say which rows are complete, so the restart keeps the report files and rebuilds what is done from them
(gpu_server/spool/recovery.py). An unreadable last line without its newline is a line the server was killed while
writing: its records are simply checked again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable

from gpu_server import disk
from gpu_server.atomic_file import write_atomic
from gpu_server.seqset import SeqSet

log = logging.getLogger("gpu_server")

INTERVAL_S = 0.05      # completions are journaled in groups at most this often
COMPACT_BYTES = 64 << 20   # past this much appended, the journal is compacted into one snapshot line again

Key = tuple  # (run_id, rank, seq)


@dataclasses.dataclass
class JournalState:
    done: dict[tuple[str, int], SeqSet] = dataclasses.field(default_factory=dict)
    half: set[Key] = dataclasses.field(default_factory=set)
    files: dict[str, int] = dataclasses.field(default_factory=dict)
    ends: dict[tuple[str, int], dict] = dataclasses.field(default_factory=dict)
    quarantined: dict[Key, str] = dataclasses.field(default_factory=dict)   # not done yet -> why
    damaged: str = ""              # why the journal cannot be trusted ("" when it can)
    exists: bool = False

    def is_done(self, key: Key) -> bool:
        seqs = self.done.get((key[0], int(key[1])))
        return seqs is not None and int(key[2]) in seqs

    def mark_done(self, key: Key) -> None:
        self.done.setdefault((key[0], int(key[1])), SeqSet()).add(int(key[2]))
        self.half.discard((key[0], int(key[1]), int(key[2])))
        self.quarantined.pop((key[0], int(key[1]), int(key[2])), None)

    def done_count(self) -> int:
        return sum(len(s) for s in self.done.values())

    def snapshot(self) -> dict:
        done: dict[str, dict[str, list]] = {}
        for (run, rank), seqs in sorted(self.done.items()):
            done.setdefault(run, {})[str(rank)] = seqs.ranges()
        snap = {"done": done, "half": sorted(list(k) for k in self.half), "files": dict(sorted(self.files.items())),
                "ends": list(self.ends.values())}
        if self.quarantined:   # only while some quarantined record is not reported yet
            snap["quarantined"] = sorted([*k, why] for k, why in self.quarantined.items())
        return snap


def _key(item) -> Key:
    run, rank, seq = item
    if not isinstance(run, str):
        raise ValueError("run id is not a string")
    return run, int(rank), int(seq)


def _apply(state: JournalState, item: dict, first: bool) -> None:
    if "snapshot" in item:
        if not first:
            raise ValueError("a snapshot after the first line")
        snap = item["snapshot"]
        for run, ranks in snap.get("done", {}).items():
            for rank, ranges in ranks.items():
                seqs = state.done.setdefault((run, int(rank)), SeqSet())
                for a, b in ranges:
                    seqs.add_range(int(a), int(b))
        state.half = {_key(k) for k in snap.get("half", [])}
        state.files.update({str(k): int(v) for k, v in snap.get("files", {}).items()})
        for end in snap.get("ends", []):
            state.ends[(end["run_id"], int(end["rank"]))] = end
        _quarantine(state, snap.get("quarantined", []))
        return
    if first:
        raise ValueError("the first line is not a snapshot")
    for k in item.get("d", []):
        state.mark_done(_key(k))
    for k in item.get("h", []):
        state.half.add(_key(k))
    state.files.update({str(k): int(v) for k, v in item.get("f", {}).items()})
    _quarantine(state, item.get("q", []))
    if "end" in item:
        end = item["end"]
        state.ends[(end["run_id"], int(end["rank"]))] = end


def _quarantine(state: JournalState, items: list) -> None:
    for run, rank, seq, why in items:
        key = _key((run, rank, seq))
        if not state.is_done(key):
            state.quarantined[key] = str(why)


def read_journal(path: str) -> JournalState:
    """The journal's state, read line by line (a long session's journal can be large)."""
    state = JournalState()
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return state
    state.exists = True
    n = -1
    with fh:
        for n, line in enumerate(fh):
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise ValueError("not an object")
                _apply(state, item, first=n == 0)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                if n > 0 and not line.endswith(b"\n"):      # only the last line can lack its newline
                    log.warning("spool: the last journal line is cut off (the server was killed while writing it); "
                                "the records it named are checked again")
                    continue
                state.damaged = f"line {n + 1} of {path} is unreadable ({exc})"
                break
    if n < 0:
        state.damaged = f"{path} is empty"
    state.half = {k for k in state.half if not state.is_done(k)}
    return state


class Journal:
    """Appends journal lines and fsyncs them in groups, after the report files they describe. Keeps `state` (what
    the journal says) up to date, and compacts the file into one snapshot line once COMPACT_BYTES were appended, so
    a long session's journal stays bounded.

    Two locks: `_cv` guards only the lines waiting to be written, so `add` (a worker thread's, after every record)
    never waits for a write or fsync in progress; `_io` serialises the writing (take what waits, fsync the report
    files, write, fsync, apply to `state`), so the lines reach the file in the order they were added."""

    def __init__(self, path: str, fsync: bool, on_journaled: Callable[[list[Key]], None]):
        self.path = path
        self.fsync = fsync
        self.on_journaled = on_journaled
        self.state = JournalState()
        self.appended = 0
        self.compactions = 0
        self._cv = threading.Condition()
        self._io = threading.Lock()
        self._buf: list[dict] = []
        self._keys: list[Key] = []
        self._files: set[str] = set()
        self._fd = -1
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failed = 0

    def open(self, state: JournalState) -> None:
        """Replace the journal with one snapshot line of `state` (kept up to date from now on), then append."""
        self.state = state
        self._rewrite()
        self._thread = threading.Thread(target=self._loop, name="gpu-server-journal", daemon=True)
        self._thread.start()

    def _rewrite(self) -> None:
        line = json.dumps({"snapshot": self.state.snapshot()}, separators=(",", ":")) + "\n"
        write_atomic(self.path, lambda fh: fh.write(line), fsync=self.fsync)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.appended = 0

    def add(self, line: dict, done: list[Key], files) -> None:
        with self._cv:
            self._buf.append(line)
            self._keys.extend(done)
            self._files.update(files)
            self._cv.notify_all()

    def add_now(self, line: dict) -> None:
        """Append and fsync at once (an end message, before it is acknowledged)."""
        with self._cv:
            self._buf.append(line)
        self.flush()

    def flush(self) -> None:
        """Write and fsync every line added so far (those a flush in progress took are written before)."""
        with self._io:
            if self._fd < 0:   # not opened yet, or closed: what waits stays
                return
            with self._cv:
                lines, keys, files = self._buf, self._keys, self._files
                self._buf, self._keys, self._files = [], [], set()
            self._write(lines, keys, files)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._buf and not self._closed:
                    self._cv.wait()
                if not self._buf and self._closed:
                    return
            self.flush()
            time.sleep(INTERVAL_S)

    def _write(self, lines: list[dict], keys: list[Key], files: set[str]) -> None:
        """(Under `_io`.) Append `lines`, after the report files they describe are on disk."""
        if not lines:
            return
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
        data = ("\n".join(json.dumps(x, separators=(",", ":")) for x in lines) + "\n").encode("utf-8")
        since = time.monotonic()
        while True:
            before = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                if self.fsync:
                    os.fsync(self._fd)
                break
            except OSError as exc:
                os.ftruncate(self._fd, before)      # never a half line
                if disk.is_full(exc) and disk.wait_for_space(self.path, since):
                    continue
                self.failed += 1
                log.error("spool: cannot write %s (%s); %d records stay in the spool and are checked again after a "
                          "restart", self.path, exc, len(keys))
                return
        for item in lines:
            _apply(self.state, item, first=False)
        self.on_journaled(keys)
        self.appended += len(data)
        if self.appended >= COMPACT_BYTES:
            try:
                self._rewrite()
                self.compactions += 1
            except OSError as exc:   # the appended journal is still whole: try again later
                self.appended = 0
                log.warning("spool: cannot compact %s (%s); it keeps growing for now", self.path, exc)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.flush()
        with self._io:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
