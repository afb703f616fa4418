"""The shared-folder side of the server (docs/design.md §5, shared folder): polls `run_ut.nfs_path/rank*/` for record
files
written by `npu_agent/transport_folder.py` and feeds them to the intake.

Rules:

* Only names the agent writes are read: `{run_id}.rank{r}.{seq:012d}.rec` and `{run_id}.rank{r}.end` inside
  `rank{r}/` (the same r). A `.rec` file holds one record, or one Batch frame of consecutive records from the
  sequence number of its name on (small records written together: one file, one fsync). Nothing from a file's
  content is ever used as a path. Hidden files (temporary files being written, NFS silly-renames) are ignored. Any
  other file, and any file whose content is not one valid record (or batch) matching its name, is reported once
  and moved aside to `nfs_path/rejected/`.
* Each run and rank is processed in sequence order. A missing sequence number is waited for; it is skipped (with a
  warning) only when that run's end marker has been present for `gap_grace_s`, since the agent writes the marker
  after every record it will ever write. The end marker is handled after every record before it.
* A file is deleted only once the intake has answered each of its records (durable in the spool, or refused). The
  reader does not wait for that before it reads the next file (at most `UNSETTLED_FILES` wait), so the spool writes
  while the next records are read and decoded; every file is settled before an end marker is handled and before a
  pass ends. After a restart of the server, whatever is left in
  the folder is read again (the intake drops duplicates within a run).
* Sizes are checked against the limits before anything is allocated: a frame is at most `max_frame_bytes`, a
  record's payload at most `max_record_bytes` and never more than the file holds.
* Every byte is reserved in the server's memory budget (`--memory-mb`) before it is read, by the same
  `RecordStream` (gpu_server/intake/stream.py) as the gRPC transport: each frame's bytes, then each complete
  record's estimated peak (held until the workers checked it). A record whose check would need more than the whole
  budget is moved aside.
* Symbolic links are never followed, anywhere below `nfs_path` (docs/security.md): each `rank{r}/` is opened once
  per pass with O_NOFOLLOW | O_DIRECTORY and every later open, unlink and rename is relative to that descriptor, so
  a folder swapped for a link meanwhile is not entered; record files are opened with O_NOFOLLOW | O_NONBLOCK and
  must be regular files; files are moved aside only into a `rejected/` that is a real directory owned by the
  server's user (created by it), opened the same way. A link planted anywhere is moved aside itself (rename never
  follows it) or left alone.
* An end marker counts only for a run and rank whose records reached the server through the folder
  (`Intake.end_backed`), and below `--world-size` when it is given.
* Stopping (SIGTERM, `stop`): the agent counted every published file as delivered, so the server takes them all.
  Polling ends with the file in hand, then one sweep reads every complete record file already in the folder (final
  names only, never the agent's hidden temporary files), in sequence order and without waiting for gaps, and the end
  markers after them; each file is reserved in the memory budget before it is read and spooled and handed to the
  workers like any other, so the drain that follows (`ServerApp.finish`) reports them in this run. A file the sweep
  cannot read (or that the time limit of `stop` leaves unread) stays in the folder for the next start.
* Every file name that reaches the log is escaped (`protos.limits.log_text`).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import re
import stat
import threading
import time
from typing import Callable, Generator

from google.protobuf.message import DecodeError

from gpu_server.intake.admission import Intake
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.intake.budget import ByteBudget
from gpu_server.intake.stream import Arrival, RecordStream, Stopped
from protos import online_check_pb2 as pb
from protos.folder_format import END_FILE, FOLDER_MAGIC, FRAME_LENGTH, RANK_DIR, RECORD_FILE
from protos.framing import data_field_at, parse_frame
from protos.limits import DEFAULT_LIMITS, Limits, log_text

log = logging.getLogger("gpu_server")

_LEN = FRAME_LENGTH
_SAFE = re.compile(r"[^A-Za-z0-9._-]", re.ASCII)
REJECTED_DIR = "rejected"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
ORIGIN = "folder"   # who sent the folder's records, for Intake.end_backed
TURN_GROUP = 64     # rank folders whose streams take turns together in a pass (FolderReader.poll_once)
UNSETTLED_FILES = 8   # files read whose records are not all durable yet, at most, before the reader waits for one
# A frame's first bytes, read apart to put its data straight into place (_read_frames): the fields before the data
# must lie in them. A chunk's take a few bytes; a record frame's header grows with its tensors (5.8 KiB for a
# backward record of the mid transformer of bench/server.py).
HEAD_BYTES = 16 << 10


class _Dir:
    """A `rank{r}/` folder opened without following links: `fd` for every operation inside, `path` for messages."""

    __slots__ = ("path", "fd", "name")

    def __init__(self, path: str, fd: int, name: str):
        self.path, self.fd, self.name = path, fd, name

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)


class BadFile(Exception):
    """A file that is not what its name promises; the message says why."""


@dataclasses.dataclass
class _Stream:
    """Progress of one run and rank in this process."""
    next_seq: int | None = None
    end_seen_at: float | None = None
    ended: bool = False
    gap_warned: int = -1
    gap_since: float | None = None
    gap_reported: bool = False


class FolderReader:
    """Reads the shared folder's record files on a thread and hands their frames to a `RecordStream` each (a
    `RecordSource`)."""

    def __init__(self, nfs_path: str, intake: Intake, limits: Limits = DEFAULT_LIMITS,
                 on_end: Callable[[pb.End], None] | None = None, min_poll_s: float = 0.02, max_poll_s: float = 1.0,
                 gap_grace_s: float = 3.0, budget: ByteBudget | None = None, sweep_on_stop: bool = True):
        self.nfs_path = nfs_path
        self.intake = intake
        self.limits = limits
        self.budget = budget if budget is not None else intake.budget
        self.on_end = on_end or (lambda end: None)
        self.min_poll_s = min_poll_s
        self.max_poll_s = max_poll_s
        self.gap_grace_s = gap_grace_s
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._reported: set[str] = set()
        self._stop = threading.Event()    # stop polling (then sweep, `sweep_on_stop`)
        self._halt = threading.Event()    # give up now: the file in hand is finished or left, nothing more is read
        self._sweeping = False
        self.sweep_on_stop = sweep_on_stop
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.swept = 0   # record files the stop's sweep processed
        self._unsettled: collections.deque = collections.deque()   # (folder, file, answers) not deleted yet

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> str:
        if not os.path.isdir(self.nfs_path):
            raise OSError(f"run_ut.nfs_path {self.nfs_path!r} is not a directory")
        self._thread = threading.Thread(target=self._run, name="gpu-server-folder", daemon=True)
        self._thread.start()
        return ""

    def shutdown(self) -> None:
        self.stop()

    def counts(self) -> dict[str, int]:
        return {"folder_files_read_at_stop": self.swept}   # record files the stop's sweep read (`sweep`)

    def stop(self, timeout: float = 600.0) -> None:
        """Stop polling; the file being processed is finished first (never half-accepted). Then, with
        `sweep_on_stop`, every complete record file already in the folder is read and handed to the intake (`sweep`)
        before this returns, within `timeout` seconds: what is left then stays for the next start."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shared folder %s: the files still unread after %.0f s of stopping stay in the folder for "
                        "the next start", self.nfs_path, timeout)
            self._halt.set()
            self._thread.join(30.0)

    def _run(self) -> None:
        delay = self.min_poll_s
        while not self._stop.is_set():
            try:
                busy = self.poll_once()
            except Exception:  # noqa: BLE001 - a bug or a vanished folder must not end the reader
                self.errors += 1
                if self.errors <= 3:
                    log.exception("shared folder %s: error while polling; retrying", self.nfs_path)
                busy = False
            delay = self.min_poll_s if busy else min(delay * 2, self.max_poll_s)
            self._stop.wait(delay)
        if self.sweep_on_stop and not self._halt.is_set():
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - what the sweep did not read stays for the next start
                log.exception("shared folder %s: error while reading the files left at the stop", self.nfs_path)

    def sweep(self, passes: int = 4) -> int:
        """Read every complete record file in the folder now, in sequence order, without waiting for missing
        sequence numbers, and the end markers after them; the number of record files processed. A pass that
        found an end marker's last records published meanwhile is followed by another, `passes` at most."""
        self._sweeping = True
        before = self.swept
        try:
            for _ in range(passes):
                if self._halt.is_set() or not self.poll_once():
                    break
        finally:
            self._sweeping = False
        n = self.swept - before
        if n:
            log.info("shared folder %s: %d record files left in the folder at the stop were read and accepted",
                     self.nfs_path, n)
        return n

    def _cut(self) -> bool:
        """Whether the pass in progress ends early: halted, or stopping with a sweep to follow."""
        return self._halt.is_set() or (self._stop.is_set() and not self._sweeping)

    # -- one pass ------------------------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Process everything that is ready now. True when anything was processed.

        The streams (one per run and rank) take turns, one record file each (`_take_turns`): a rank with a backlog
        (a folder written before the server started, or a rank whose worker is slower) does not hold back the
        others while it waits for the memory budget, so each rank's worker gets its records as soon as the budget
        allows (gpu-server --workers 2: one worker per rank). Within a stream the order is the sequence order. The
        rank folders take turns in groups of `TURN_GROUP` (each open folder holds a descriptor)."""
        try:
            entries = list(os.scandir(self.nfs_path))
        except OSError as exc:
            self._report_once(f"dir:{self.nfs_path}", "cannot list the shared folder %s: %s", self.nfs_path, exc)
            return False
        busy = False
        folders: list[_Dir] = []
        streams: list[Generator[bool, None, bool]] = []
        try:
            for entry in sorted(entries, key=lambda e: e.name):
                m = RANK_DIR.match(entry.name)
                if m:
                    folder = self._open_dir(entry.name)
                    if folder is not None:
                        folders.append(folder)
                        streams += self._poll_rank(folder, int(m.group(1)))
                        if len(folders) >= TURN_GROUP:
                            busy |= self._take_turns(streams)
                            streams = []
                            self._settle(0)   # their files are deleted before their folders close
                            while folders:
                                os.close(folders.pop().fd)
                if self._cut():
                    break
            busy |= self._take_turns(streams)
        finally:
            try:
                self._settle(0)
            finally:
                for folder in folders:
                    os.close(folder.fd)
        return busy

    def _take_turns(self, streams: list[Generator[bool, None, bool]]) -> bool:
        """Run the streams' generators (`_poll_stream`) round robin, one step (one record file) each per turn, until
        every one has finished; True when any processed something."""
        busy = False
        while streams:
            still = []
            for stream in streams:
                try:
                    busy |= next(stream)
                except StopIteration as done:
                    busy |= bool(done.value)
                    continue
                still.append(stream)
            streams = still
        return busy

    def _open_dir(self, name: str) -> _Dir | None:
        """`nfs_path/name` opened as a real directory (never through a link), or None (reported once)."""
        path = os.path.join(self.nfs_path, name)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                self._report_once(f"dir:{path}", "shared folder: %s is not a directory (a symbolic link or a file); "
                                                 "it is ignored", path)
            return None
        return _Dir(path, fd, name)

    def _poll_rank(self, folder: _Dir, rank: int) -> list[Generator[bool, None, bool]]:
        """The rank's streams (one per run) with something to do, as `_poll_stream` generators; files with names
        that are not the agent's are moved aside now."""
        try:
            names = os.listdir(folder.fd)
        except OSError:
            return []
        records: dict[str, dict[int, str]] = {}
        ends: dict[str, str] = {}
        for name in names:
            if name.startswith("."):
                continue  # being written by the agent (or an NFS silly-rename): never read
            m = RECORD_FILE.match(name)
            if m and int(m.group(2)) == rank:
                records.setdefault(m.group(1), {})[int(m.group(3))] = name
                continue
            m = END_FILE.match(name)
            if m and int(m.group(2)) == rank:
                ends[m.group(1)] = name
                continue
            self._move_aside(folder, name, f"the name is not '{{run}}.rank{rank}.{{seq:012d}}.rec' or "
                                           f"'{{run}}.rank{rank}.end'")
        return [self._poll_stream(folder, run_id, rank, records.get(run_id, {}), ends.get(run_id))
                for run_id in sorted(set(records) | set(ends))]

    def _poll_stream(self, folder: _Dir, run_id: str, rank: int, files: dict[int, str],
                     end: str | None) -> Generator[bool, None, bool]:
        """One run and rank's ready files in sequence order, then its end marker: a generator that yields after each
        record file it processed (whether it processed anything so far: the other streams take their turn,
        `_take_turns`) and returns that at its end. It checks `_cut()` before each file, as before."""
        st = self._streams.setdefault((run_id, rank), _Stream())
        if st.ended and not files and end is None:
            return False
        now = time.monotonic()
        if end is not None and st.end_seen_at is None:
            st.end_seen_at = now
        busy = False
        pending = sorted(files)
        if st.next_seq is None and pending:
            # First sight of this stream in this process: earlier files were processed and deleted (by us before a
            # restart) or it starts at 0. The agent publishes in order, so the lowest file present is the next.
            st.next_seq = pending[0]
        for seq in pending:
            if self._cut():
                return busy
            if seq < st.next_seq:
                # Older than what this process already handled (a re-published file): the intake dedupes it.
                busy |= self._process_record(folder, files[seq], run_id, rank, seq) > 0
                yield busy
                continue
            if seq > st.next_seq and self._sweeping:
                # stopping: the files present are all there is to read now; a missing one is read at the next start
                log.warning("shared folder: run %s rank %d: records %d..%d are not in the folder at the stop; going "
                            "on with %d", run_id, rank, st.next_seq, seq - 1, seq)
                st.next_seq = seq
            if seq > st.next_seq:
                end_settled = st.end_seen_at is not None and now - st.end_seen_at >= self.gap_grace_s
                if not end_settled:
                    if st.gap_since is None or st.gap_warned != st.next_seq:
                        st.gap_since, st.gap_warned = now, st.next_seq
                    elif now - st.gap_since > 30 and not st.gap_reported:
                        st.gap_reported = True
                        log.warning("shared folder: run %s rank %d: waiting for record %d (%s) before %d", run_id,
                                    rank, st.next_seq, log_text(folder.join(
                                        f"{run_id}.rank{rank}.{st.next_seq:012d}.rec"), 300), seq)
                    return busy  # wait for the gap to fill
                log.warning("shared folder: run %s rank %d: records %d..%d never arrived (the agent ended without "
                            "them); going on with %d", run_id, rank, st.next_seq, seq - 1, seq)
                st.next_seq = seq
            covered = self._process_record(folder, files[seq], run_id, rank, seq)
            if not covered:
                return busy
            st.next_seq = seq + covered
            st.gap_since, st.gap_reported = None, False
            busy = True
            yield busy
        handled = set(files.values())
        if end is not None:
            # Every record the agent wrote was published before its end marker; a listing taken before the marker
            # appeared may still miss the last ones, so look once more before ending the stream.
            try:
                later = [n for n in os.listdir(folder.fd) if (m := RECORD_FILE.match(n)) and m.group(1) == run_id
                         and int(m.group(2)) == rank and int(m.group(3)) >= (st.next_seq or 0)
                         and n not in handled]
            except OSError:
                later = []
            if later:
                return True
            self._settle(0)   # the end marker counts once every record before it is durable, as before
            self._process_end(folder, end, run_id, rank, st)
            busy = True
        return busy

    # -- files ---------------------------------------------------------------------------------------------
    def _read_frames(self, folder: _Dir, name: str, asm: FrameAssembler | None = None):
        """Yield (frame, its data, bytes left in the file) of a published file, checking every size before reading
        it (the data: a view into the frame's bytes where it could be parsed apart, protos.framing.parse_frame).
        With `asm`, each frame's bytes are reserved in the memory budget before they are read, and a chunk that
        continues the record being joined, or a record frame's data that more chunks will complete, is read straight
        into its place (`_read_in_place`)."""
        # O_NOFOLLOW | O_NONBLOCK, relative to the folder opened without following links: a symlink or a FIFO
        # planted under a record's name is refused, never followed or waited on.
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder.fd)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BadFile("it is not a regular file")
            size = st.st_size
            magic = fh.read(len(FOLDER_MAGIC))
            if magic != FOLDER_MAGIC:
                raise BadFile("it does not start with the online-check folder magic (not written by npu_agent)")
            pos = len(FOLDER_MAGIC)
            while pos < size:
                head = fh.read(_LEN.size)
                if len(head) != _LEN.size:
                    raise BadFile(f"truncated frame length at byte {pos}")
                (n,) = _LEN.unpack(head)
                pos += _LEN.size
                if n > self.limits.max_frame_bytes:
                    raise BadFile(f"a {n}-byte frame at byte {pos} exceeds the limit of {self.limits.max_frame_bytes}")
                if pos + n > size:
                    raise BadFile(f"a {n}-byte frame at byte {pos} runs past the end of the {size}-byte file")
                if asm is not None and not asm.reserve(n):
                    raise Stopped()   # halted (the stop's time limit is over): the file is read at the next start
                if asm is not None and n > HEAD_BYTES:
                    placed = self._read_in_place(fh, pos, n, asm)
                    if placed is not None:
                        pos += n
                        try:
                            yield placed[0], placed[1], size - pos
                        finally:
                            placed[1].release()   # fed (or refused): the payload no longer needs it exported
                        continue
                raw = fh.read(n)
                if len(raw) != n:
                    raise BadFile(f"truncated frame at byte {pos}")
                pos += n
                try:
                    frame, data = parse_frame(raw)
                except DecodeError:
                    raise BadFile(f"the {n}-byte frame at byte {pos - n} is not a valid Frame") from None
                del raw
                yield frame, data, size - pos

    @staticmethod
    def _read_in_place(fh, pos: int, n: int, asm: FrameAssembler) -> tuple[pb.Frame, memoryview] | None:
        """The `n`-byte frame at byte `pos` of the file as (frame, its data), when `asm` has a place for its data (a
        chunk that continues the record it is joining, or a record frame whose payload more chunks will complete,
        FrameAssembler.place): its first bytes are read and parsed apart (protos.framing.data_field_at), then its
        data is read from the file straight into its place in the record's payload, not into a message of its own
        that `feed` would copy again. Else None, with the file back at `pos`: the frame is read as a whole and
        checked as before (every layout that is not the agent's, every other frame, every error). A file cut short
        meanwhile is refused with the same words as there."""
        head = fh.read(HEAD_BYTES)
        at = data_field_at(head, n) if len(head) == HEAD_BYTES else None
        view = None
        if at is not None:
            try:
                frame = pb.Frame.FromString(head[:at[0]])
            except DecodeError:
                frame = None   # refused by the whole read, in its order (a truncation first)
            if frame is not None:
                view = asm.place(frame, n - at[1])
        if view is None:
            fh.seek(pos)
            return None
        got = HEAD_BYTES - at[1]
        view[:got] = head[at[1]:]
        while got < len(view):
            k = fh.readinto(view[got:])
            if not k:
                view.release()
                raise BadFile(f"truncated frame at byte {pos}")
            got += k
        return frame, view

    def _load_records(self, folder: _Dir, name: str, run_id: str, rank: int, seq: int,
                      stream: RecordStream) -> list[Arrival]:
        """The records of one file, each with the budget bytes it holds (its estimated peak) and '', or with why it
        is refused: one record (its frames), or a batch of consecutive records starting at the name's sequence
        number (one Batch frame). Raises BadFile when the content is not what the name says; what was reserved is
        then still in `stream` (the caller closes it)."""
        done: list = []
        for frame, data, remaining in self._read_frames(folder, name, stream.asm):
            if done:
                raise BadFile("more frames follow the complete record")
            body = frame.WhichOneof("body")
            if body == "batch" and remaining:
                raise BadFile("more frames follow the batch")
            try:
                check = self._names_check(body, run_id, rank, seq, len(data) + remaining)
                done = stream.run(stream.records(frame, data, check))
            finally:
                stream.asm.drop_loose()
            refused = next((item for item in done if isinstance(item, pb.Ack)), None)
            if refused is not None:
                raise BadFile(refused.reason)
        if not done:
            raise BadFile("the file ends before the record is complete")
        return done

    def _names_check(self, body: str, run_id: str, rank: int, seq: int,
                     held: int) -> Callable[[list[pb.Record]], None]:
        """What the records of a file's frame must be (RecordStream.records `check`): the run, rank and sequence
        numbers its name says, a record announcing a payload within the limit and the `held` bytes left in the
        file."""
        def check(records: list[pb.Record]) -> None:
            for i, rec in enumerate(records):
                h = rec.header
                if (h.run_id, h.rank, h.seq) == (run_id, rank, seq + i):
                    continue
                if body == "batch":
                    raise BadFile(f"its record {i} is run {h.run_id[:64]!r} rank {h.rank} seq {h.seq}, not record "
                                  f"{seq + i} of the run and rank its name says")
                raise BadFile(f"it holds record run {h.run_id[:64]!r} rank {h.rank} seq {h.seq}, not what its name "
                              "says")
            announced = records[0].payload_bytes if body == "record" else 0
            if announced > self.limits.max_record_bytes:
                raise BadFile(f"it announces {announced} payload bytes, above the limit of "
                              f"{self.limits.max_record_bytes}")
            if announced > held:
                raise BadFile(f"it announces {announced} payload bytes but the file holds at most {held}")
        return check

    def _process_record(self, folder: _Dir, name: str, run_id: str, rank: int, seq: int) -> int:
        """Handle one record file: the number of sequence numbers it covered (a batch file covers several), or 0
        when it could not be read now (retry later, keep the order)."""
        path = folder.join(name)
        stream = RecordStream(self.intake, self.limits, self.budget, ORIGIN, self.on_end, cancelled=self._halt.is_set)
        try:
            records = self._load_records(folder, name, run_id, rank, seq, stream)
        except FileNotFoundError:
            return 1  # removed meanwhile (another reader of the same folder); nothing to do
        except Stopped:
            return 0
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # a read error (NFS hiccup, permissions): try again on a later poll
                self._report_once(path, "shared folder: cannot read %s (%s); retrying", path, exc)
                return 0
            stream.refuse_file()
            self._move_aside(folder, name, "it is a symbolic link")
            return 1
        except BadFile as exc:
            stream.refuse_file()
            self._move_aside(folder, name, str(exc))
            return 1
        finally:
            stream.asm.close()   # what no record took (a file refused half-way)
        n = len(records)
        records.reverse()
        answers = []
        try:
            while records:
                item = records.pop()
                before = self.intake.not_replayable
                out = stream.answer(item)   # spooled (its ticket answers once durable), or refused at once
                valid = self.intake.not_replayable > before   # valid, but not replayable here: not "rejected"
                answers.append((item.record.header.seq, valid, out))
                del item
        finally:
            stream.release(records)   # records not handed to the intake (an error above): their bytes go back
        self._unsettled.append((folder, name, answers))
        self._settle(UNSETTLED_FILES)
        return n

    def _settle(self, keep: int) -> None:
        """Delete the files whose records are all durable, oldest first, until at most `keep` wait (0: wait for
        every one). A file is deleted only once the intake has answered each of its records (durable in the spool,
        or refused), as before; the reader does not wait for that before it reads the next file (the spool writes
        while the next record is read and decoded, and the records that came meanwhile share its next fsync)."""
        while self._unsettled and (len(self._unsettled) > keep or all(
                isinstance(out, pb.Ack) or out.ready() for _seq, _valid, out in self._unsettled[0][2])):
            folder, name, answers = self._unsettled.popleft()
            for rec_seq, valid, out in answers:
                status, reason = (out.status, out.reason) if isinstance(out, pb.Ack) else out.wait()
                if status == pb.Ack.REJECTED and valid:
                    log.info("shared folder: %s (record %d) is not replayable here (a SKIP row says why): %s",
                             log_text(name, 300), rec_seq, reason)
                elif status == pb.Ack.REJECTED:
                    log.warning("shared folder: %s (record %d) rejected: %s", log_text(name, 300), rec_seq, reason)
            self._remove(folder, name)
            if self._sweeping:
                self.swept += 1

    def _process_end(self, folder: _Dir, name: str, run_id: str, rank: int, st: _Stream) -> None:
        path = folder.join(name)
        try:
            frames = list(self._read_frames(folder, name))
            if len(frames) != 1 or frames[0][0].WhichOneof("body") != "end":
                raise BadFile("an end marker must hold exactly one End frame")
            end = frames[0][0].end
            if (end.run_id, end.rank) != (run_id, rank):
                raise BadFile(f"it holds the end of run {end.run_id[:64]!r} rank {end.rank}, not what its name says")
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                self._report_once(path, "shared folder: cannot read %s (%s); retrying", path, exc)
                return
            self._move_aside(folder, name, "it is a symbolic link")
            return
        except BadFile as exc:
            self._move_aside(folder, name, str(exc))
            return
        if not st.ended:
            st.ended = True
            stream = RecordStream(self.intake, self.limits, self.budget, ORIGIN, self.on_end,
                                  where=f"shared folder: {log_text(path, 300)}")
            stream.run(stream.end(end))
        self._remove(folder, name)
        st.end_seen_at = None

    def _remove(self, folder: _Dir, name: str) -> None:
        try:
            os.unlink(name, dir_fd=folder.fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            path = folder.join(name)
            self._report_once(path, "shared folder: cannot delete %s after processing it (%s); it will be read again "
                                    "and dropped as a duplicate", path, exc)

    def _move_aside(self, folder: _Dir, name: str, why: str) -> None:
        src = folder.join(name)
        if src in self._reported:
            return
        base = f"{folder.name}_{_SAFE.sub('_', name)[:200]}"
        rejected = self._rejected_dir()
        if rejected is None:
            self._reported.add(src)
            where = (f"left in place ({os.path.join(self.nfs_path, REJECTED_DIR)} is not a real directory owned by "
                     "this server's user, so nothing is moved into it)")
        else:
            try:
                dest, n = base, 1
                while _exists(dest, rejected):
                    dest, n = f"{base}.{n}", n + 1
                # rename never follows a link: neither the file (a planted link is moved as a link) nor, being
                # relative to descriptors of real directories, any folder on the way
                os.rename(name, dest, src_dir_fd=folder.fd, dst_dir_fd=rejected)
                where = f"moved to {os.path.join(self.nfs_path, REJECTED_DIR, dest)}"
            except FileNotFoundError:
                return
            except OSError as exc:
                self._reported.add(src)
                where = f"left in place (cannot move it: {exc})"
            finally:
                os.close(rejected)
        log.warning("shared folder: %s is not a valid record file: %s; %s", log_text(src, 300), why,
                    log_text(where, 400))

    def _rejected_dir(self) -> int | None:
        """A descriptor of `nfs_path/rejected/`, created by the server (mode 0700) if missing; None when that name
        is anything but a real directory owned by the server's user (a planted link, a file, another user's)."""
        path = os.path.join(self.nfs_path, REJECTED_DIR)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            return None
        return fd

    def _report_once(self, key: str, msg: str, *args) -> None:
        args = tuple(a if isinstance(a, int) else log_text(str(a), 300) for a in args)
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning(msg, *args)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
