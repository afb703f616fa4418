"""The shared-folder transport (SPEC §4, last bullet): records as files instead of a gRPC stream.

Layout under `tensor.nfs_path` (the server reads the same folder as `run_ut.nfs_path`)::

    rank{r}/{run_id}.rank{r}.{seq:012d}.rec     one record: its Frames, exactly as on the gRPC stream
    rank{r}/{run_id}.rank{r}.end                end of stream: one End Frame with the counts
    rank{r}/.{final name}.{pid}.tmp             being written (hidden: the server never reads it)

File format (`protos.codec`, shared with `gpu_server/folder.py`): the 8 bytes `FOLDER_MAGIC`, then frames, each as
a 4-byte little-endian length followed by one serialized `Frame` (the same bytes `protos.codec.encode_frames` yields).

Publishing a file: write it under the temporary name, fsync it, rename it to the final name (atomic within a
folder), fsync the folder. Only then is the record acknowledged to the Sender: an acknowledged record is on disk
and is never lost. The run id, rank and sequence number are in the name, so the server can order and dedupe
without reading content. A record that cannot be written (the folder is gone, the disk is full) is retried with
back-off; the training keeps running within the memory budget, and one warning says what is happening.
"""
from __future__ import annotations

import logging
import os
import struct
import threading

from npu_agent.records import PendingRecord, encode_record
from protos import online_check_pb2 as pb
from protos.codec import FOLDER_MAGIC, encode_frames, folder_end_name, folder_record_name
from protos.limits import CHUNK_BYTES

log = logging.getLogger("npu_agent")

_LEN = struct.Struct("<I")


def rank_dir(nfs_path: str, rank: int) -> str:
    return os.path.join(nfs_path, f"rank{rank}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def publish(folder: str, name: str, frames) -> int:
    """Write `frames` (an iterable of serialized Frames) durably to `folder/name`. Returns the bytes written."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    written = 0
    try:
        with open(tmp, "wb") as fh:
            fh.write(FOLDER_MAGIC)
            written += len(FOLDER_MAGIC)
            for frame in frames:
                fh.write(_LEN.pack(len(frame)))
                fh.write(frame)
                written += _LEN.size + len(frame)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    return written


class FolderTransport:
    """Same interface as `GrpcTransport`: the Sender sets `on_ack`/`on_reconnect` and calls `send_record`,
    `send_end` and `close` from its thread; `describe_state` is for its messages."""

    def __init__(self, nfs_path: str, run_id: str, rank: int, world_size: int, chunk_bytes: int = CHUNK_BYTES,
                 max_retry_s: float = 10.0):
        self.nfs_path = nfs_path
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.max_retry_s = max_retry_s
        self.folder = rank_dir(nfs_path, rank)
        self.on_ack = lambda seq, status, reason: None
        self.on_reconnect = lambda: None
        self._closed = threading.Event()
        self._state = "ready"
        self._warned = False
        self.bytes_written = 0

    def describe_state(self) -> str:
        return f"Shared folder {self.folder}: {self._state}."

    def _write(self, name: str, make_frames, what: str) -> bool:
        """Publish with retries until it works or the transport is closed. True when written."""
        backoff = 0.2
        while not self._closed.is_set():
            try:
                os.makedirs(self.folder, exist_ok=True)
                self.bytes_written += publish(self.folder, name, make_frames())
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
            if self._warned:
                self._warned = False
                log.warning("online check: the shared folder %s is writable again", self.folder)
            self._state = "ready"
            return True
        return False

    def send_record(self, rec: PendingRecord) -> None:
        record, enc = encode_record(rec, self.run_id, self.rank)
        frames = lambda: encode_frames(record, enc.buffers, enc.size, self.chunk_bytes)  # noqa: E731
        if self._write(folder_record_name(self.run_id, self.rank, rec.seq), frames, f"record {rec.seq} ({rec.name})"):
            self.on_ack(rec.seq, "ACCEPTED", "")

    def send_end(self, counts: dict, timeout: float) -> bool:
        end = pb.Frame(end=pb.End(run_id=self.run_id, rank=self.rank, captured=counts["captured"],
                                  sent=counts["sent"], acknowledged=counts["acknowledged"],
                                  dropped=counts["dropped"], last_seq=counts["last_seq"],
                                  world_size=self.world_size)).SerializeToString()
        timer = threading.Timer(max(0.1, timeout), self._closed.set)
        timer.daemon = True
        timer.start()
        try:
            ok = self._write(folder_end_name(self.run_id, self.rank), lambda: [end], "the end-of-stream marker")
        finally:
            timer.cancel()
        self.close()
        return ok

    def close(self) -> None:
        self._closed.set()
