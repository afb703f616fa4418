"""The shared-folder transport (docs/design.md §5, shared folder): records as files instead of a gRPC stream.

Layout under `tensor.nfs_path` (the server reads the same folder as `run_ut.nfs_path`)::

    rank{r}/{run_id}.rank{r}.{seq:012d}.rec     one record: its Frames, exactly as on the gRPC stream; or small
                                                records seq, seq+1, ... in one Batch frame
    rank{r}/{run_id}.rank{r}.end                end of stream: one End Frame with the counts
    rank{r}/.{final name}.{pid}.{random}.tmp    being written (hidden: the server never reads it)

File format and names (`protos.folder_format`, shared with `gpu_server/intake/folder.py`): the 8 bytes
`FOLDER_MAGIC`, then frames, each as a 4-byte little-endian length followed by one serialized `Frame` (the same
bytes `protos.framing` builds).

Publishing a file: write it under the temporary name, fsync it, rename it to the final name (atomic within a
folder), fsync the folder. Only then is the record acknowledged to the Sender: an acknowledged record is on disk
and is never lost. The run id, rank and sequence number are in the name, so the server can order and dedupe
without reading content. A record that cannot be written (the folder is gone, the disk is full) is retried with
back-off; the training keeps running within the memory budget, and one warning says what is happening.

Symbolic links: whoever can write to the shared folder could plant a link where the agent writes, to have it
overwrite another file of the user running the training. The agent never follows one: the rank folder is opened
with O_NOFOLLOW (a rank folder that is a symbolic link is refused: one ERROR, capture stops), and every file is
created inside it, through that open folder, with O_CREAT|O_EXCL|O_NOFOLLOW under a name nobody can guess.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterable

from npu_agent.records import PendingRecord, batch_frame, encode_record, read_back, write_file, write_frames
from npu_agent.transport import Refusal, StreamIdentity, TransportEvents
from protos.folder_format import folder_end_name, folder_record_name, rank_dir_name
from protos.limits import CHUNK_BYTES

log = logging.getLogger("npu_agent")

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))


class SymlinkRefused(OSError):
    """The rank folder is a symbolic link: the agent never writes through one."""


def rank_dir(nfs_path: str, rank: int) -> str:
    return os.path.join(nfs_path, rank_dir_name(rank))


def open_rank_dir(folder: str) -> int:
    """Create `folder` if needed and open it without following a symbolic link; returns the folder's fd.
    Raises SymlinkRefused when `folder` is a symbolic link, OSError when it cannot be opened."""
    os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)   # the configured folder: the user's choice
    try:
        os.mkdir(folder, 0o777)
    except FileExistsError:
        pass
    try:
        return os.open(folder, _DIR_FLAGS)
    except OSError as exc:
        try:
            is_link = stat.S_ISLNK(os.lstat(folder).st_mode)
        except OSError:
            is_link = False
        if is_link or exc.errno == errno.ELOOP:
            raise SymlinkRefused(errno.ELOOP, "is a symbolic link", folder) from None
        raise


def publish(dir_fd: int, name: str, content: Iterable[bytes] | Callable[[int], int],
            unpublished: Callable[[int, int], None] | None = None) -> int:
    """Write a record file durably as `name` inside the open folder `dir_fd`: `content` is its serialized Frames, or
    a function that writes the file's bytes into the open file it is given and returns how many (a large record's
    tensors copied straight from memory: npu_agent/records.py `write_file`). Returns the bytes written. The
    temporary file is created exclusively (never through a planted file or link) and renamed. Should the file not be
    published after `content` was written, `unpublished(fd, size)` is called before it is removed."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, _FILE_FLAGS, 0o666, dir_fd=dir_fd)
    written = -1
    try:
        written = content(fd) if callable(content) else write_frames(fd, 0, content)
        os.fsync(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            if written >= 0 and unpublished is not None:
                unpublished(fd, written)
        finally:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        raise
    os.close(fd)
    try:
        os.fsync(dir_fd)
    except OSError:  # some network file systems refuse fsync on a directory; the rename is still atomic
        pass
    return written


class FolderTransport:
    """Implements `npu_agent.transport.Transport` with files: one stream (generation 1), acknowledged on write."""

    copies_into_files = True

    def __init__(self, nfs_path: str, run_id: str, rank: int, world_size: int, chunk_bytes: int = CHUNK_BYTES,
                 max_retry_s: float = 10.0, connect_timeout_s: float = 30.0):
        self.nfs_path = nfs_path
        self.identity = StreamIdentity(run_id, rank, world_size)
        self.chunk_bytes = chunk_bytes
        self.max_retry_s = max_retry_s
        self.connect_timeout_s = connect_timeout_s
        self.folder = rank_dir(nfs_path, rank)
        self._events: TransportEvents | None = None
        self._closed = threading.Event()
        self._state = "ready"
        self._warned = False
        self._reached = False
        self._refused = False
        self.bytes_written = 0

    def start(self, events: TransportEvents) -> None:
        self._events = events
        events.on_reconnect(1)

    @property
    def generation(self) -> int:
        return 1 if self._events is not None else 0

    @property
    def reached(self) -> bool:
        return self._reached

    def describe_state(self) -> str:
        return f"Shared folder {self.folder}: {self._state}."

    def _write(self, name: str, make_frames: Callable[[], Iterable[bytes] | Callable[[int], int]], what: str,
               unpublished: Callable[[int, int], None] | None = None) -> bool:
        """Publish with retries until it works or the transport is closed. True when written."""
        backoff = 0.2
        while not self._closed.is_set():
            try:
                dir_fd = open_rank_dir(self.folder)
                try:
                    self.bytes_written += publish(dir_fd, name, make_frames(), unpublished)
                finally:
                    os.close(dir_fd)
            except SymlinkRefused:
                self._refuse(Refusal(f"the rank folder {self.folder} is a symbolic link (to "
                                     f"{os.path.realpath(self.folder)}); the agent never writes through one",
                                     f"remove the link ({self.folder}) and check who could create it; the agent "
                                     "creates the rank folder itself"))
                return False
            except OSError as exc:
                self._state = f"cannot write ({type(exc).__name__}: {exc})"
                if not self._warned:
                    self._warned = True
                    log.warning("online check: cannot write %s to the shared folder %s (%s: %s). Training continues; "
                                "records are kept within the memory budget and written again (retry up to every "
                                "%.0f s).", what, self.folder, type(exc).__name__, exc, self.max_retry_s)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, self.max_retry_s)
                continue
            self._reached = True
            if self._warned:
                self._warned = False
                log.warning("online check: the shared folder %s is writable again", self.folder)
            self._state = "ready"
            return True
        return False

    def _refuse(self, refusal: Refusal) -> None:
        if self._refused:
            return
        self._refused = True
        self._state = f"refused: {refusal.cause}"
        self._closed.set()
        log.error("%s", refusal.message(f"the shared folder {self.nfs_path}"))
        assert self._events is not None
        self._events.on_refused(refusal)

    def send_records(self, recs: list[PendingRecord], generation: int) -> bool:
        """Write `recs` (the folder has one stream: `generation` is always 1) and acknowledge each once on disk.
        Small records with consecutive sequence numbers share one file (one Batch frame, named by the first: one
        fsync for all); any other record gets its own file."""
        assert self._events is not None
        who = self.identity
        encoded = [encode_record(rec, who.run_id, who.rank, self.chunk_bytes) for rec in recs]
        consecutive = all(b.seq == a.seq + 1 for a, b in zip(recs, recs[1:]))
        batch = batch_frame(encoded) if consecutive else None
        if batch is not None:
            first = recs[0]
            if not self._write(folder_record_name(who.run_id, who.rank, first.seq), lambda: [batch],
                               f"records {first.seq}..{recs[-1].seq}"):
                return False
            self._events.on_ack(first.seq, "ACCEPTED", "", len(recs))
            return True
        for rec, enc in zip(recs, encoded):
            content: Callable[[], Iterable[bytes] | Callable[[int], int]]
            if enc.later is not None:   # a large record not copied yet: its tensors go straight into the file
                content = functools.partial(functools.partial, write_file, rec)
            else:
                content = functools.partial(enc.wire_frames, self.chunk_bytes)
            if not self._write(folder_record_name(who.run_id, who.rank, rec.seq), content,
                               f"record {rec.seq} ({rec.name})", functools.partial(self._unpublished, rec)):
                return False
            self._events.on_ack(rec.seq, "ACCEPTED", "")
        return True

    def _unpublished(self, rec: PendingRecord, fd: int, size: int) -> None:
        """A record file written but not published (fsync or rename failed): when its payload was copied straight
        from the training's memory, that memory is let go already, so the record's frames are read back from the
        file to be written again. Should that fail too, the record goes out skipped, with the reason."""
        if rec.encoded is None or not rec.encoded.in_file:
            return
        try:
            read_back(rec, fd, 0, size)
        except OSError as exc:
            reason = f"the agent could not write this record to the shared folder ({type(exc).__name__}: {exc})"
            log.warning("online check: record %d (%s): %s; it is sent skipped", rec.seq, rec.name, reason)
            rec.encoded, rec.skip_reason = None, reason
            encode_record(rec, self.identity.run_id, self.identity.rank, self.chunk_bytes)

    def send_end(self, frame: bytes, timeout: float) -> bool:
        timer = threading.Timer(max(0.1, timeout), self._closed.set)
        timer.daemon = True
        timer.start()
        try:
            who = self.identity
            ok = self._write(folder_end_name(who.run_id, who.rank), lambda: [frame], "the end-of-stream marker")
        finally:
            timer.cancel()
        self.close()
        return ok

    def close(self) -> None:
        self._closed.set()
